"""Training checkpoints: ``checkpoint-STEP/`` folders (the model, the training state as JSON plus
safetensors, never a pickle), the best model by a dev metric, and what ``--resume`` reads back."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..base.args import closest
from ..base.errors import DiskFullError, DprGcError, is_disk_full
from ..base.guard import check_outputs, lies_within, remove_stale_folders, with_temporaries
from ..base.files import (JSON_ERRORS, atomic_open, read_json, read_tensors, remove_folder,
                          remove_stale_temporaries)
from ..base.validate import Field, check_fields, count
from ..model.card import card_training
from ..model.pretrained import CHECKPOINT_RE, LEGACY_STATE, SHARDED, STATE_JSON, checkpoint_steps
from .config import HIGHER_IS_BETTER, SETTINGS_FILE
from ..model.retriever import Retriever

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"  # one JSON record per logged step, in the training output
FINAL, BEST = "final", "best"  # the trained model and the best one on the dev set, in the training output
# What a run writes or removes in its --output: the files and folders above, the checkpoints, and the hidden ones
# beside them (.checkpoint-STEP.tmp, atomic_folder's .final.*/.best.* and the files' .NAME.*.tmp); no input may be
# one or lie inside one.
TRAIN_MEMBERS = with_temporaries(SETTINGS_FILE, METRICS_FILE, FINAL, BEST, CHECKPOINT_RE)

STATE_FIELDS = {"step": count(), "optimizer": Field(dict, True), "scheduler": Field(dict), "scaler": Field(dict),
                "sampler": Field(dict), "record": Field(dict, True), "best": Field(list),
                "skipped_steps": count(), "skipped_in_a_row": count()}  # fp16 steps the GradScaler skipped
STATE_TENSORS = "train_state.safetensors"


def to_plain(obj: Any, key: str, tensors: dict) -> Any:
    """``obj`` as JSON-ready data, its tensors and arrays moved into ``tensors`` (for safetensors) under ``key``.

    Dicts become key/value pair lists and tuples are marked, so int keys (optimizer state) and tuples (Python's RNG
    state) come back as they were; floats survive JSON exactly (``repr`` round-trips), NaN and infinities (not JSON:
    a skipped fp16 step's gradient norm) as marked strings.
    """
    if isinstance(obj, torch.Tensor):
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        tensors[key] = torch.from_numpy(obj.astype(np.int64) if obj.dtype.kind in "ui" else obj.copy())
        return {"__ndarray__": key, "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        return {"__dict__": [[k, to_plain(v, f"{key}.{i}", tensors)] for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, tuple):
        return {"__tuple__": [to_plain(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [to_plain(v, f"{key}.{i}", tensors) for i, v in enumerate(obj)]
    if isinstance(obj, float) and not math.isfinite(obj):
        return {"__float__": repr(float(obj))}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return to_plain(obj.item(), key, tensors)
    raise TypeError(f"cannot store a {type(obj).__name__} in the training state ({key})")


def from_plain(obj: Any, tensors: dict, source: Path) -> Any:
    """Invert :func:`to_plain`."""
    if isinstance(obj, list):
        return [from_plain(v, tensors, source) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__dict__" in obj:
        return {k: from_plain(v, tensors, source) for k, v in obj["__dict__"]}
    if "__tuple__" in obj:
        return tuple(from_plain(v, tensors, source) for v in obj["__tuple__"])
    if obj.get("__float__") in ("nan", "inf", "-inf"):
        return float(obj["__float__"])
    key = obj.get("__tensor__", obj.get("__ndarray__"))
    if key not in tensors:
        raise DprGcError(f"{source}: tensor {key!r} is missing from {STATE_TENSORS}; the checkpoint is damaged")
    if "__ndarray__" in obj:
        return tensors[key].numpy().astype(obj["dtype"])
    return tensors[key]


def write_state(folder: Path, state: dict) -> None:
    """Write the training state as ``train_state.json`` plus ``train_state.safetensors`` (no pickle)."""
    from safetensors.torch import save_file

    tensors: dict = {}
    plain = to_plain(state, "state", tensors)
    save_file(tensors, str(folder / STATE_TENSORS))
    with open(folder / STATE_JSON, "w", encoding="utf-8") as f:
        json.dump(plain, f)
        f.write("\n")


def read_state(folder: Path) -> dict:
    """Read the training state of a checkpoint folder without unpickling anything.

    A folder from before this format (``state.pt``) is read with ``torch.load(weights_only=True)``, which admits
    tensors and NumPy arrays only.
    """
    if not (folder / STATE_JSON).is_file() and (folder / LEGACY_STATE).is_file():
        with torch.serialization.safe_globals(numpy_globals()):
            return read_tensors(folder / LEGACY_STATE)
    tensors = read_tensors(folder / STATE_TENSORS)
    try:
        state = from_plain(read_json(folder / STATE_JSON), tensors, folder / STATE_JSON)
    except (TypeError, ValueError, KeyError, AttributeError):
        state = None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        raise DprGcError(f"{folder / STATE_JSON}: not a dpr-gc training state; resume from another checkpoint")
    check_fields(state, folder / STATE_JSON, STATE_FIELDS, "a training state",
                 required=("scheduler", "scaler", "sampler", "best"))
    if len(state["best"]) not in (2, 3):  # [value, path] before the step was recorded
        raise DprGcError(f"{folder / STATE_JSON}: 'best' must be [value, path, step]; resume from another checkpoint")
    return state


def numpy_globals() -> list:
    """The NumPy names an old ``state.pt`` needs (NumPy's RNG state is an array): data types, not code."""
    from numpy.dtypes import UInt32DType

    core = getattr(np, "_core", None) or np.core
    return [core.multiarray._reconstruct, np.ndarray, np.dtype, UInt32DType]


def finished_checkpoints(out: Path) -> list[Path]:
    """The finished ``checkpoint-STEP`` folders in ``out``, oldest first."""
    folders = (out / f"checkpoint-{step}" for step in checkpoint_steps(out))
    return [p for p in folders if (p / STATE_JSON).is_file() or (p / LEGACY_STATE).is_file()]


def resolve_checkpoint(out: Path, resume: str) -> Path:
    """The checkpoint folder ``--resume`` names: ``latest`` in ``out``, or a folder holding a training state (a
    missing one spelt close to latest, ``lastest``, is named with latest; any other is refused naming the finished
    checkpoints ``out`` holds)."""
    if resume == "latest":
        found = finished_checkpoints(out)
        if not found:
            raise DprGcError(f"--resume latest: no finished checkpoint in {out}")
        return found[-1]
    path = Path(resume)
    if not os.path.lexists(path) and closest(resume.lower(), ["latest"]):
        raise DprGcError(f"--resume {resume}: no such checkpoint folder; did you mean latest (the last checkpoint in "
                         "--output)?")
    if not (path / STATE_JSON).is_file() and not (path / LEGACY_STATE).is_file():
        found = finished_checkpoints(out)
        there = (f"--output {out} holds {', '.join(p.name for p in found)} (give one's path, e.g. {found[-1]}, or "
                 "latest)" if found else f"--output {out} holds no finished checkpoint (run without --resume to "
                 "start anew)")
        raise DprGcError(f"--resume {resume}: not a checkpoint folder (expected {path}/{STATE_JSON}); {there}")
    return path


def check_layout(checkpoint: Path, fsdp: bool) -> None:
    """A checkpoint resumes only as it was written: sharded weights with ``--fsdp``, a whole model without."""
    if fsdp != (checkpoint / SHARDED).is_dir():
        written = "without" if fsdp else "with"
        raise DprGcError(f"{checkpoint}: this checkpoint was written {written} --fsdp; resume it the same way")


def check_start(out: Path, resume: Optional[str], inputs: Optional[Mapping[str, Any]] = None) -> None:
    """Before the model and data are loaded: ``--resume`` names a checkpoint that ``--output`` neither is nor lies
    inside (the run would write into the checkpoint it reads), and a new run is refused a folder
    holding an earlier run's checkpoints, ``final/`` or ``best/`` (a new run would leave the earlier ``best/``
    beside its own ``final/``), or an input (``inputs``: ``{flag: path or paths}``) inside the starting model's
    ``best/`` that it would remove (:func:`left_at_start`). An empty ``--resume`` is refused, not read as none
    given."""
    if resume is not None and not resume.strip():
        raise DprGcError("--resume is empty; give a checkpoint folder or 'latest'")
    if resume:
        check_outputs({"--resume": resolve_checkpoint(out, resume)}, {"--output": out})
        return
    if finished_checkpoints(out):
        raise DprGcError(f"{out} already holds checkpoints: pass --resume latest to continue, "
                         "or choose a new --output")
    done = [name for name in ("final", "best") if (out / name).exists() and not (name == "best" and left_at_start(out))]
    if done:
        raise DprGcError(f"{out} already holds the trained model of an earlier run "
                         f"({', '.join(n + '/' for n in done)}); choose a new --output, or delete it first")
    if left_at_start(out):
        check_inputs_kept(out / "best", inputs or {})


def checkpoint_step(folder: Path) -> int:
    """The step of a ``checkpoint-STEP`` folder."""
    return int(folder.name.removeprefix("checkpoint-"))


def check_inputs_kept(best: Path, inputs: Mapping[str, Any]) -> None:
    """Refuse an input inside ``best``, the starting model an interrupted run left, which a new run removes."""
    for flag, value in inputs.items():
        for path in value if isinstance(value, (list, tuple)) else [value]:
            if path is not None and lies_within(path, best):
                raise DprGcError(f"{flag} {path} lies inside {best}, the starting model an interrupted run left, "
                                 "which a new run in this --output removes: copy it elsewhere and start from the "
                                 "copy, or choose a new --output")


def left_at_start(out: Path) -> bool:
    """Whether ``out/best`` is what a run stopped before its first checkpoint leaves: the starting model (saved when
    the dev set was evaluated before training; its card records 0 steps) beside no ``final/`` and no checkpoint.
    Nothing trained is lost when a new run replaces it."""
    best = out / "best"
    return (best.is_dir() and not (out / "final").exists() and not finished_checkpoints(out)
            and card_training(best).get("steps") == 0)


class Checkpointer:
    """Writes ``checkpoint-STEP/`` folders (model in Hugging Face format, the training state as JSON + safetensors)
    atomically, keeps the last few, keeps a copy of the best model in ``best/`` by the chosen dev metric, and
    reloads them for ``--resume``."""

    def __init__(self, out: Path, keep: int, metric: str, is_main: bool, sharded: Optional[nn.Module] = None) -> None:
        self.out, self.keep, self.metric, self.is_main = out, max(1, keep), metric, is_main
        self.sharded = sharded  # an FSDP model: its weights and optimizer state go to sharded/ (every rank writes)
        self.best_value: Optional[float] = None
        self.best_path: Optional[str] = None
        self.best_step: Optional[int] = None  # 0: the starting model (no step beat its dev score)
        self.settings: Optional[Callable[[Path], Any]] = None  # writes the run's settings into a checkpoint folder

    def _better(self, value: float) -> bool:
        if self.best_value is None:
            return True
        return value > self.best_value if self.metric in HIGHER_IS_BETTER else value < self.best_value

    def checkpoints(self) -> list[Path]:
        return finished_checkpoints(self.out)

    def log(self, path: Path, record: dict) -> None:
        """Append ``record`` to the JSON lines file ``path``, a non-finite number as null (JSON has no NaN)."""
        if self.is_main:
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(finite_or_null(record), allow_nan=False) + "\n")

    def update_best(self, step: int, export: Callable[[], Optional[Retriever]], record: dict) -> None:
        """Save the model to ``best/`` (atomically) when the record's dev metric beats every one seen so far
        (``export``: the retriever to save on the main rank, called on every rank). The starting model's (step 0,
        before training) is the first: it is saved, and a later step must beat it."""
        value = record.get(f"dev_{self.metric}")
        if value is None or not self._better(value):
            return
        self.best_value, self.best_path, self.best_step = float(value), str(self.out / "best"), step
        retriever = export()
        if self.is_main:
            retriever.save(self.out / "best")  # whole or not at all (a temporary sibling renamed into place)
            if step == 0:
                logger.info("dev %s %.4f of the starting model is the baseline: %s holds it until a step beats it",
                            self.metric, value, self.best_path)
            else:
                logger.info("new best dev %s %.4f at step %d -> %s", self.metric, value, step, self.best_path)

    def save(self, step: int, retriever: Retriever, optimizer: Any, scheduler: Any, scaler: Any, sampler_state: dict,
             rng: Any, record: dict, grad_cache: Any = None, skipped: tuple[int, int] = (0, 0)) -> None:
        """Write ``checkpoint-STEP/`` whole: into a hidden sibling renamed into place, which a failure (a full disk:
        one error line naming the checkpoint) removes again, so the finished checkpoints stay as they were.
        ``grad_cache``: what the Gradient Cache engine learnt (each rank's :meth:`GradCache.state_dict`);
        ``skipped``: the steps fp16's GradScaler skipped, in all and the latest in a row."""
        tmp = self.out / f".checkpoint-{step}.tmp"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        try:
            self._write(tmp, step, retriever, optimizer, {"step": step, "optimizer": None,
                                                           "scheduler": scheduler.state_dict(),
                                                           "scaler": scaler.state_dict(), "sampler": sampler_state,
                                                           "rng": rng, "record": record, "grad_cache": grad_cache,
                                                           "best": [self.best_value, self.best_path,
                                                                    self.best_step],
                                                           "skipped_steps": skipped[0],
                                                           "skipped_in_a_row": skipped[1]})
        except BaseException as e:  # Ctrl-C too: a checkpoint's temporary is a whole model copy
            if self.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
            if is_disk_full(e):
                resume = "with --resume latest" if self.checkpoints() else "again"  # latest needs a finished one
                raise DiskFullError(self.out / f"checkpoint-{step}", f"free space, then run the same command {resume}"
                                    ) from None
            raise
        if dist.is_initialized():
            dist.barrier()

    def _write(self, tmp: Path, step: int, retriever: Retriever, optimizer: Any, state: dict) -> None:
        """The checkpoint's files into ``tmp``, then ``tmp`` renamed to ``checkpoint-STEP`` (old ones beyond
        ``keep`` deleted)."""
        if self.sharded is not None:
            from ..model.fsdp import save_sharded

            dist.barrier()
            save_sharded(tmp / SHARDED, self.sharded, optimizer)
        if self.is_main:
            if self.sharded is None:
                retriever.save(tmp / "model")
            write_state(tmp, {**state, "optimizer": optimizer.state_dict() if self.sharded is None else None})
            if self.settings is not None:
                self.settings(tmp)
            final = self.out / f"checkpoint-{step}"
            remove_folder(final)
            tmp.rename(final)
            for old in self.checkpoints()[:-self.keep]:
                remove_folder(old)

    def resolve(self, resume: str) -> Path:
        return resolve_checkpoint(self.out, resume)

    def load(self, resume: str, retriever: Retriever, optimizer: Any, scheduler: Any, scaler: Any,
             device: torch.device) -> dict:
        """Restore a checkpoint; ``latest`` whose files are damaged (an interrupted copy, a full disk) falls back to
        the previous finished checkpoint, saying so."""
        path = self.resolve(resume)
        older = self.checkpoints()[:-1] if resume == "latest" else []
        while True:
            check_layout(path, self.sharded is not None)  # before reading: a sharded one has no model/
            try:
                state = read_state(path)
                saved = Retriever.load(path / "model") if self.sharded is None else None
                break
            except DprGcError as e:
                if not older:
                    raise
                logger.warning("%s is damaged (%s); resuming from the previous checkpoint %s", path, e, older[-1])
                path = older.pop()
        try:
            if self.sharded is not None:
                from ..model.fsdp import load_sharded

                load_sharded(path / SHARDED, self.sharded, optimizer)
            else:
                retriever.load_state_dict(saved.state_dict())
                optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            scaler.load_state_dict(state["scaler"])
            self.best_value, self.best_path, *step = state["best"]
            self.best_step = step[0] if step else None
        except DprGcError:
            raise
        except (KeyError, ValueError, TypeError, RuntimeError) as e:
            raise DprGcError(f"{path}: this checkpoint does not fit the run ({str(e).splitlines()[0][:200]}); "
                             "resume with the settings it was made with, or from another checkpoint") from None
        self.adopt_best(path, state["step"], saved)
        self.drop_later(path, state["step"], saved)
        if self.is_main:
            truncate_metrics(self.out / METRICS_FILE, state["step"])
        return state

    def drop_later(self, checkpoint: Path, step: int, saved: Optional[Retriever]) -> None:
        """A resume of an earlier checkpoint of this ``--output`` goes on from its step, as metrics.jsonl does: the
        later checkpoints, and a ``final/`` or ``best/`` of a later step, belong to the run being redone and are
        removed, said in one line (kept, rotation removed the resumed run's own checkpoints, ``--resume latest`` and
        ``final/`` took the old run's last step). ``best/`` becomes the checkpoint's model where that is the best
        recorded, else the next dev evaluation writes it."""
        if os.path.realpath(checkpoint.parent) != os.path.realpath(self.out):
            return
        later = [p for p in self.checkpoints() if checkpoint_step(p) > step]
        later += [self.out / name for name in ("final", "best")
                  if card_training(self.out / name).get("steps", 0) > step]
        best_gone = self.out / "best" in later
        if best_gone:
            self.best_value, self.best_path, self.best_step = ((self.best_value, self.best_path, step)
                                                               if saved is not None and self.best_step == step
                                                               else (None, None, None))
        if dist.is_initialized():
            dist.barrier()  # every rank has read the folders before the first one removes them
        if self.is_main and later:
            for folder in later:
                remove_folder(folder)
            logger.warning("resuming %s, an earlier checkpoint of %s: removed what the run it redoes wrote after "
                           "step %d (%s)", checkpoint.name, self.out, step, ", ".join(p.name + "/" for p in later))
            if best_gone and self.best_path is not None:
                save_with_card(saved, checkpoint, self.out / "best")

    def adopt_best(self, checkpoint: Path, step: int, saved: Optional[Retriever]) -> None:
        """A resume into a new ``--output``: the recorded ``best/`` is the resumed run's, which may by now hold
        another step's model. When the checkpoint's own model is the best one recorded (``saved``, its step the
        best step), it is copied into this output's ``best/``; otherwise the record is reset, said in one line, and
        the next dev evaluation writes ``best/`` here."""
        here = os.path.realpath(self.out)
        if self.best_path is None:
            return
        if here == os.path.realpath(checkpoint.parent):  # recorded as the run spelt it, maybe from another folder
            self.best_path = str(self.out / "best")
            return
        if here == os.path.dirname(os.path.realpath(self.best_path)):
            return
        recorded, best_step = self.best_path, self.best_step
        self.best_path = str(self.out / "best")
        if saved is not None and best_step == step:
            if self.is_main:
                save_with_card(saved, checkpoint, self.out / "best")
                logger.info("%s: the best model recorded (step %d) is this checkpoint's: copied to %s", checkpoint,
                            step, self.best_path)
            return
        self.best_value, self.best_path, self.best_step = None, None, None
        if self.is_main:
            logger.info("%s has no best/ yet: the best model recorded, %s (step %s), belongs to the run resumed; the "
                        "next dev evaluation writes best/ here", self.out, recorded, best_step)


def save_with_card(saved: Retriever, checkpoint: Path, folder: Path) -> None:
    """Save a checkpoint's model (``saved``, read from ``checkpoint/model``) to ``folder`` whole or not at all, its
    model card keeping the training record the checkpoint's holds (steps, data, dev metrics)."""
    saved.training_info = {**card_training(checkpoint / "model"), **saved.training_info}
    saved.save(folder)


def remove_temporaries(out: Path) -> list[Path]:
    """Delete what a killed run left half-written in its output folder ``out``, each a hidden sibling of what it was
    writing: ``.checkpoint-STEP.tmp/``, ``best/``'s and ``final/``'s (:func:`~dpr_gc.base.guard.atomic_folder`'s
    ``.NAME.*.new``/``.old``) and the settings and metrics files' (``.NAME.*.tmp``); the removal is logged. Call it
    where no other run writes into ``out`` (train's output lock; rank 0 only)."""
    removed = [*remove_stale_folders(out, BEST), *remove_stale_folders(out, FINAL)]
    for tmp in out.glob(".checkpoint-*.tmp") if out.is_dir() else ():
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
    removed += remove_stale_temporaries(out, [SETTINGS_FILE, METRICS_FILE])
    if removed:
        logger.info("removed what a killed run left half-written in %s: %s", out, ", ".join(p.name for p in removed))
    return removed


def finite_or_null(value: Any) -> Any:
    """``value`` with each non-finite float inside it (NaN, infinities: not JSON) made None, written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def truncate_metrics(metrics: Path, step: int) -> None:
    """Keep the records of ``metrics.jsonl`` up to ``step``; a partial last line (the writer was killed) is dropped."""
    if not metrics.is_file():
        return
    lines = metrics.read_text(encoding="utf-8", errors="replace").splitlines()
    kept = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except JSON_ERRORS:
            if number == len(lines):
                logger.warning("%s: dropped a partial last line (the run was interrupted while writing it)", metrics)
                break
            raise DprGcError(f"{metrics}:{number}: invalid JSON; fix or delete that line, then resume") from None
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            kept.append(line)
    with atomic_open(metrics) as f:
        f.write("".join(line + "\n" for line in kept))
