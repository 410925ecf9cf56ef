"""What the benchmark scripts share: where a results file goes by default (``benchmarks/results/STEM.json`` only
for a run sized as the one that wrote the committed file; any other run without ``--output``, a smoke run or one with
fewer rounds, steps or rows, goes to ``STEM-quick.json``, or into the work folder of the SciFact scripts that keep
one, so it never overwrites committed results), their command line (comma-separated list flags, a CUDA device
checked up front), how a script runs (a bad input is one ``error:`` line and exit status 2, as for ``dpr-gc``; the
dependencies' INFO lines and progress bars off, as ``dpr-gc`` has them without ``--verbose``) and the
``| item | value |`` table it ends with."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import logging
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# the CPU features a step's speed depends on (bf16 and int8 kernels, AMX tiles)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
sys.path.insert(0, str(ROOT))

from dpr_gc.base.args import ArgumentParser  # noqa: E402
from dpr_gc.base.errors import DprGcError, report_errors  # noqa: E402
from dpr_gc.base.logs import quiet_dependencies  # noqa: E402
from dpr_gc.base.tables import format_summary  # noqa: E402


def results_path(stem: str, smoke: bool) -> str:
    """The default results file ``benchmarks/results/STEM.json``, or ``STEM-quick.json`` for a smoke run
    (``--quick``, ``--tiny``) or any other run not sized as the committed one (see :func:`default_output`)."""
    return str(RESULTS / f"{stem}{'-quick' if smoke else ''}.json")


def committed_size(parse: Callable[[list[str]], argparse.Namespace], args: argparse.Namespace,
                   sizing: Iterable[str], committed: Sequence[Sequence[str]] = ((),)) -> bool:
    """Whether ``args`` has, for every destination in ``sizing`` (the flags that size a run: steps, rounds, rows,
    lengths, the smoke flags), the value one of the ``committed`` command lines gives (the flags of the run that
    wrote the committed results file, the parser's defaults for the rest) as ``parse`` reads it."""
    names = list(sizing)
    return any(all(getattr(args, name) == getattr(full, name) for name in names)
               for full in (parse(list(argv)) for argv in committed))


def default_output(stem: str, parse: Callable[[list[str]], argparse.Namespace], args: argparse.Namespace,
                   sizing: Iterable[str], committed: Sequence[Sequence[str]] = ((),)) -> str:
    """``--output`` when given; else ``benchmarks/results/STEM.json`` for a run sized as a ``committed`` command
    (see :func:`committed_size`), ``STEM-quick.json`` for any other, so a smaller (or larger) trial run never
    overwrites the committed results."""
    if getattr(args, "output", None):
        return str(args.output)
    return results_path(stem, not committed_size(parse, args, sizing, committed))


def output_help(stem: str) -> str:
    """The ``--output`` flag's help for a script whose default is :func:`default_output`'s."""
    return (f"results JSON (default: benchmarks/results/{stem}.json for a run sized as the committed one, else "
            f"{stem}-quick.json)")


def cpu_model() -> tuple[str, list[str]]:
    """The CPU's model name and which of :data:`CPU_FLAGS` it has (from /proc/cpuinfo; elsewhere the platform's
    processor name and no flags)."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and name in (platform.processor(), platform.machine()):
                    name = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    return name, [flag for flag in CPU_FLAGS if flag in flags]


def version(package: str) -> Optional[str]:
    """An installed package's version without importing it (None when it is not installed)."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_info(device: str = "cpu", threads: Optional[int] = None) -> dict:
    """What every results file records of the run: the date-time (UTC), the CPU's model and the flags of interest,
    its logical CPUs and the threads used, torch's and Python's versions, the device (and GPU's name), the load
    average at the start and the command line, so a figure can be traced to the machine and conditions."""
    cpu, flags = cpu_model()
    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu,
            "cpu_flags": flags, "logical_cpus": os.cpu_count(), "threads": threads, "torch": version("torch"),
            "transformers": version("transformers"), "python": platform.python_version(), "device": device,
            "load_average_at_start": os.getloadavg(), "command": shlex.join(sys.argv)}
    if str(device).startswith("cuda"):
        import torch

        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def machine_text(info: Mapping[str, Any]) -> str:
    """The machine of a :func:`machine_info` record in a few words: CPU (and GPU), device and the load at the start."""
    load = info.get("load_average_at_start") or [None]
    parts = [str(info.get("gpu") or info.get("cpu") or "?"), str(info.get("device") or "cpu")]
    return ", ".join(parts) + ("" if load[0] is None else f", load {load[0]:.1f}")


def summary_table(items: Mapping[str, Any], output: Any, info: Mapping[str, Any], seconds: float) -> str:
    """The short ``| item | value |`` table a benchmark ends with (``dpr_gc``'s :func:`format_summary`): ``items``
    (the figures that matter, e.g. the ratios against its baseline), the results file ``output``, the machine of
    ``info`` (a :func:`machine_info` record) and the run's ``seconds``."""
    return format_summary({**items, "results file": str(output), "machine": machine_text(info)}, seconds)


def parser(doc: str, paragraph: bool = False) -> argparse.ArgumentParser:
    """A script's parser, described by the first line (or ``paragraph``: the first paragraph) of its docstring: a
    bad flag or value is one ``error:`` line and exit status 2, and ``--help`` shows every option's default."""
    text = doc.strip()
    return ArgumentParser(description=text.split("\n\n")[0] if paragraph else text.splitlines()[0])


def int_list(text: str) -> list[int]:
    """A list flag's type: comma-separated positive integers (``8,32,128``)."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers (e.g. 8,32)")
    return values


def name_list(text: str) -> list[str]:
    """A list flag's type: comma-separated names (``plain,gc``), empty entries dropped."""
    return [x for x in text.split(",") if x]


def check_choices(flag: str, given: list[str], choices: tuple[str, ...]) -> None:
    """Refuse names in ``given`` that are not among ``choices``, naming the flag."""
    unknown = [x for x in given if x not in choices]
    if unknown or not given:
        raise DprGcError(f"{flag} {','.join(unknown) or '(none)'}: choose from {','.join(choices)}")


def require_cuda(device: str) -> None:
    """Refuse ``--device cuda`` (or ``cuda:N``) where torch sees no CUDA device, before anything starts."""
    import torch

    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise DprGcError(f"--device {device}: torch sees no CUDA device on this machine; run it where one is, or "
                         "give --device cpu")


def setup_logging(fmt: str = "%(asctime)s %(message)s", level: int = logging.INFO) -> None:
    """A script's log: its own lines at ``level`` in ``fmt``; the dependencies' (FAISS's loader, datasets' "JAX
    version ... available", transformers' "Loading weights" and "Writing model shards" bars) quiet, children too."""
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S")
    quiet_dependencies()


def run_script(main: Callable[[], Any]) -> int:
    """Run a script's ``main`` as a command, the dependencies quiet from the start (see :func:`setup_logging`): a
    :class:`DprGcError` or an ``OSError`` becomes one ``error:`` line and exit status 2 (see
    :func:`dpr_gc.base.errors.report_errors`); the exit status to pass to ``sys.exit``."""
    quiet_dependencies()
    return report_errors(main)
