"""The output guard every stage and script runs under: one lock per output, no output that is an input or another
output of the same run, and whole-folder replacement.

A stage declares which of its command-line destinations are inputs and which are outputs (:func:`guarded`); before the
stage runs, every output is compared with every input and with the other outputs by what it resolves to (``realpath``)
and, for paths that exist, by ``(st_dev, st_ino)`` -- so a symlink or a hard link to an input is refused too, and so is
an input named as a file kept beside an output (``.NAME.*``: its lock, partial file, progress record or temporaries); no
output may lie inside an input folder, and a folder replaced whole may not hold an input, nor may an input be (or lie
inside) a member a stage writes into its output folder (``members``: the files and folders it names there, which the run
overwrites or removes). Then each output is locked (``flock``; a second run on the same output is refused at once)
unless the stage takes its own finer lock (``"self"``). The parsed-data cache a command is given (``--cache-dir``) is
one of its outputs too (:data:`CACHE_OUTPUT`), and the cache folder it uses, given or the default, is probed for writing
up front (:func:`check_cache_writable`). Files are written atomically by :mod:`dpr_gc.base.files`; folders by
:func:`atomic_folder`.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

from .errors import DiskFullError, DprGcError, alike_on_every_rank, is_disk_full, messages_rewritten
from .files import (BESIDE_BYTES, PathLike, beside, check_output_dir, check_path_length, missing_folders,
                    output_target, remove_empty_folders, spooled, written_beside)
from .locks import exclusive_lock, locked_folder, output_lock

# How an output is locked: a lock file beside it ("file": files, and folders replaced whole), a lock file inside it
# ("folder": folders written into), or by the stage itself ("self": e.g. one lock per shard).
LOCK_MODES = ("file", "folder", "whole", "self")
FOLDER_LOCK = ".dpr-gc.lock"
# The parsed-data cache folder (``--cache-dir``, declared once by ``settings.cache_dir_setting``): an output of every
# guarded command whose arguments carry it, so that it is never an input nor inside an input folder; its caches lock
# their own files. Left out (None), the caches go to the default folder (:func:`default_cache_root`), which is
# checked as an output when $DPR_GC_CACHE names it; given or not, the folder is probed up front
# (:func:`check_cache_writable`).
CACHE_OUTPUT = ("cache_dir", "self")
CACHE_VARIABLE = "DPR_GC_CACHE"
# A PEFT adapter's config, whose base_model_name_or_path names the model the adapter is read on top of: a local one
# is an input of any command given the adapter (:func:`with_adapter_bases`).
ADAPTER_CONFIG = "adapter_config.json"
# what the system says when it refuses to create a file or folder: no permission, a read-only file system, a name
# longer than the file system takes (a lock or temporary file beside an output, on a file system of shorter names)
REFUSED_ERRNOS = (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENAMETOOLONG)
# A member a stage writes into its output folder: an exact name, or a pattern its whole name matches (``fullmatch``).
Member = Union[str, "re.Pattern[str]"]


def with_temporaries(*members: Member) -> tuple[Member, ...]:
    """``members`` of an output folder and the temporaries written beside each (``.NAME.<anything>``), as a stage
    declares them to :func:`guarded`."""
    names = "|".join(m.pattern if isinstance(m, re.Pattern) else re.escape(m) for m in members)
    return (*members, re.compile(rf"\.(?:{names})\..+"))


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _paths(value: Any) -> list[Path]:
    if value is None or value == "":
        return []
    if isinstance(value, (list, tuple)):
        return [p for v in value for p in _paths(v)]
    return [Path(os.fspath(value))] if isinstance(value, (str, os.PathLike)) else []


def _identity(path: Path) -> tuple[str, Optional[tuple[int, int]]]:
    """What ``path`` resolves to: its real path, and ``(st_dev, st_ino)`` when it exists (hard links share it)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(path)
        return real, (st.st_dev, st.st_ino)
    except OSError:
        return real, None


def _same(a: tuple[str, Any], b: tuple[str, Any]) -> bool:
    return a[0] == b[0] or (a[1] is not None and a[1] == b[1])


def _inside(inner: tuple[str, Any], folder: Path) -> bool:
    """Whether the path identified by ``inner`` lies inside ``folder`` (also through links to it)."""
    real = os.path.realpath(folder)
    return os.path.commonpath([inner[0], real]) == real and inner[0] != real


def check_outputs(inputs: Mapping[str, Any], outputs: Mapping[str, Any], whole: Iterable[str] = (),
                  members: Optional[Mapping[str, Sequence[Member]]] = None) -> None:
    """Refuse any output that resolves to an input or to another output (``{flag: path or paths}``), any output
    inside an input folder (a model's, an index's, a BEIR folder's files), any input inside an output folder
    named in ``whole`` (such folders are replaced as a whole), and any input that is or lies inside a member
    (``members``: ``{flag: names or patterns}``) the stage writes into an output folder. An output that is a device,
    pipe or socket is refused too (:func:`~dpr_gc.base.files.output_target`), and so is a name too long for the
    lock and temporary files written beside it (:data:`~dpr_gc.base.files.BESIDE_BYTES`)."""
    ins = [(flag, p, _identity(p)) for flag, value in inputs.items() for p in _paths(value)]
    outs = [(flag, p, _identity(p)) for flag, value in outputs.items() for p in _paths(value)]
    for flag, path, _ in outs:
        check_path_length(path, flag, BESIDE_BYTES)
        output_target(path, flag)
    for i, (flag, path, ident) in enumerate(outs):
        for in_flag, in_path, in_ident in ins:
            if _same(ident, in_ident):
                raise DprGcError(f"{flag} {path} is the input {in_flag} {in_path} (same file or a link to it); "
                                 "write the output somewhere else, inputs are never overwritten")
            if written_beside(in_path, path):
                raise DprGcError(f"the input {in_flag} {in_path} has the name of a file {flag} {path} keeps beside "
                                 "it (its lock, partial file, progress record or a temporary), which the run would "
                                 "delete or overwrite; rename the input or write the output elsewhere")
            if os.path.isdir(in_path) and _inside(ident, in_path):
                raise DprGcError(f"{flag} {path} lies inside the input {in_flag} {in_path}; write the output "
                                 "outside the input's folder, inputs are never overwritten")
            if flag in whole and _inside(in_ident, path):
                raise DprGcError(f"{flag} {path} holds the input {in_flag} {in_path} and would be replaced whole; "
                                 "write the output somewhere else")
            member = _member(in_path, path, (members or {}).get(flag, ()))
            if member is not None:
                raise DprGcError(f"the input {in_flag} {in_path} is {member} in the output folder {flag} {path}, "
                                 "which the run writes or removes; move the input out of that folder, or give "
                                 f"another {flag}")
        for other_flag, other_path, other_ident in outs[:i]:
            if _same(ident, other_ident):
                raise DprGcError(f"{flag} {path} and {other_flag} {other_path} are the same path (or links to "
                                 "one); give each output its own path")


def _matches(name: str, members: Sequence[Member]) -> bool:
    return any(name == m if isinstance(m, str) else m.fullmatch(name) is not None for m in members)


def _member(candidate: Path, folder: Path, members: Sequence[Member]) -> Optional[str]:
    """The member of ``folder`` (a name ``members`` matches) that ``candidate`` is or lies inside, followed through
    links or as spelt up to its last name (a link the writer would replace or remove), or that is a hard link to
    it; None if none."""
    if not members:
        return None
    real = os.path.realpath(folder)
    spelt = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(candidate))), candidate.name)
    for place in (os.path.realpath(candidate), spelt):
        if os.path.commonpath([place, real]) == real and place != real:
            name = os.path.relpath(place, real).split(os.sep)[0]
            if _matches(name, members):
                return name
    ident = _identity(candidate)
    for name in sorted(os.listdir(real)) if os.path.isdir(real) and ident[1] is not None else ():
        if _matches(name, members) and _same(_identity(Path(real, name)), ident):
            return name
    return None


def lies_within(path: PathLike, folder: PathLike) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it, also through links (compared as :func:`check_outputs`
    compares an output with an input)."""
    ident = _identity(Path(path))
    return _same(ident, _identity(Path(folder))) or _inside(ident, Path(folder))


def with_adapter_bases(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """``inputs`` plus the local base model folder each LoRA adapter among them names (``adapter_config.json``
    in an input folder or a tower or checkpoint folder under it, two levels down): loading the adapter reads that
    folder, so an output may no more be it or lie inside it than the input itself."""
    found = dict(inputs)
    for flag, value in inputs.items():
        for path in _paths(value):
            if not path.is_dir():
                continue
            configs = [c for pattern in ("", "*/", "*/*/") for c in sorted(path.glob(pattern + ADAPTER_CONFIG))]
            for config in configs:
                try:
                    base = json.loads(config.read_text(encoding="utf-8")).get("base_model_name_or_path")
                except (OSError, ValueError, AttributeError):  # the loader refuses such a file in its own words
                    continue
                if isinstance(base, str) and base.strip() and os.path.exists(base):
                    found[f"{flag} {path} (the base model its {config.relative_to(path)} names)"] = base
    return found


def check_inputs_given(inputs: Mapping[str, Any]) -> None:
    """Refuse an input given as an empty path (``--queries ""``): ``Path("")`` is the working folder, read as
    whatever the flag expects, with an error naming another flag."""
    for flag, value in inputs.items():
        values = value if isinstance(value, (list, tuple)) else [value]
        if any(isinstance(v, str) and not v.strip() for v in values):
            raise DprGcError(f"{flag} is empty; give a path")
        for v in values:
            if isinstance(v, (str, os.PathLike)):
                check_path_length(v, flag)


@contextlib.contextmanager
def output_locks(outputs: Mapping[str, tuple[Any, str]]) -> Iterator[None]:
    """Hold one lock per output (``{flag: (path, mode)}``, modes in :data:`LOCK_MODES`) for the block. Under
    ``torchrun`` only rank 0 locks (every rank runs the same command on the same output)."""
    if os.environ.get("RANK", "0") != "0":
        yield
        return
    with contextlib.ExitStack() as stack:
        for flag, (value, mode) in outputs.items():
            for path in _paths(value):
                if mode == "folder":  # a run that writes nothing there leaves no empty folder behind
                    stack.callback(remove_empty_folders, missing_folders(path))
                    stack.enter_context(locked_folder(path, FOLDER_LOCK, f"{flag} {path}"))
                elif mode == "file":
                    stack.enter_context(output_lock(path))
                elif mode == "whole":
                    stack.enter_context(exclusive_lock(beside(path, ".lock"), f"{flag} {path}"))
                    target = output_target(path, flag)  # a link's target is where the new folder is made
                    remove_stale_folders(target.parent, target.name)
        yield


def _split(entry: str) -> tuple[str, str]:
    """``"dest"`` or ``"dest=--flag"`` (when the flag's name is not the destination's)."""
    dest, _, flag = entry.partition("=")
    return dest, flag or _flag(dest)


def guarded(inputs: Sequence[str] = (), outputs: Optional[Mapping[str, str]] = None,
            members: Optional[Mapping[str, Sequence[Member]]] = None) -> Callable:
    """Decorate a stage's command function ``f(args, ...)``: ``inputs`` are the ``args`` destinations it reads,
    ``outputs`` maps each destination it writes to its lock mode (see :data:`LOCK_MODES`); an entry may be written
    ``"dest=--flag"`` to name the flag in messages. ``members`` maps an output folder's destination to the names
    or patterns of what the stage writes or removes inside it: no input may be or lie inside one. The cache folder
    (:data:`CACHE_OUTPUT`) is an output without being declared (declare it to name another flag); a command whose
    ``args`` carry it has the folder it uses probed (:func:`check_cache_writable`). Checks, then locks, then runs; an
    output the system refuses to create or write is one line naming its flag (:func:`refused_output`)."""
    outputs = dict(outputs or {})
    bad = set(outputs.values()) - set(LOCK_MODES)
    if bad:
        raise ValueError(f"unknown lock modes {sorted(bad)}")
    ins = [_split(e) for e in inputs]
    outs = [(*_split(e), mode) for e, mode in outputs.items()]
    cache_dest, cache_mode = CACHE_OUTPUT
    if all(dest != cache_dest for dest, _, _ in outs):
        outs.append((cache_dest, _flag(cache_dest), cache_mode))
    cache_flag = next(flag for dest, flag, _ in outs if dest == cache_dest)
    owned = {flag: (members or {}).get(dest, ()) for dest, flag, _ in outs}

    def wrap(run: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(run)
        def guarded_run(args: Any, *more: Any, **named: Any) -> Any:
            given = {flag: getattr(args, dest, None) for dest, flag in ins}
            written = {flag: getattr(args, dest, None) for dest, flag, _ in outs}
            with alike_on_every_rank():  # every torchrun rank checks the same flags and paths
                check_inputs_given(given)
                check_outputs(with_adapter_bases(given), with_default_cache(written, cache_flag),
                              whole=[flag for _, flag, mode in outs if mode == "whole"], members=owned)
                if hasattr(args, cache_dest):  # the command uses the cache
                    check_cache_writable(written[cache_flag], cache_flag)
            try:
                with output_locks({flag: (written[flag], mode) for _, flag, mode in outs}):
                    with streams_copied(args, [dest for dest, _ in ins]):
                        return run(args, *more, **named)
            except OSError as e:
                refusal = refused_output(e, with_default_cache(written, cache_flag))
                if refusal is None:
                    raise
                raise refusal from None

        return guarded_run

    return wrap


def default_cache_root() -> tuple[Path, Optional[str]]:
    """The folder the parsed-data caches go to without ``--cache-dir``: ``$DPR_GC_CACHE`` (``~`` expanded, as a
    quoted value keeps it), else ``~/.cache/dpr_gc``; and the variable's name in messages when it set the folder
    (None for the home default)."""
    folder = os.environ.get(CACHE_VARIABLE)
    return (Path(folder).expanduser(), f"${CACHE_VARIABLE}") if folder else (Path.home() / ".cache" / "dpr_gc", None)


def with_default_cache(outputs: Mapping[str, Any], cache_flag: str) -> dict[str, Any]:
    """``outputs`` plus ``$DPR_GC_CACHE`` where the cache flag is not given and that variable names the cache folder:
    the caches are written there, so it may no more be an input or lie inside one than ``--cache-dir``."""
    folder, variable = default_cache_root()
    if outputs.get(cache_flag) is not None or variable is None:
        return dict(outputs)
    return {**outputs, variable: str(folder)}


def check_cache_writable(given: Any, cache_flag: str) -> None:
    """Refuse up front, in one line naming what set it, a cache folder this user cannot create or write in:
    ``cache_flag`` when given, else ``$DPR_GC_CACHE``, else ``~/.cache/dpr_gc`` (a run failed only when it first wrote
    a cache, ``train`` after its model loaded, naming no flag nor variable). The probe is a temporary folder made and
    removed in the cache folder, or in its nearest existing parent: nothing is left behind. A folder that exists is
    not probed: caches built earlier may be read from a read-only one (a cache still to write there is refused when
    it is written, naming the same). Any error of the probe refuses the folder."""
    if given is not None:
        folder, label, advice = Path(os.fspath(given)), cache_flag, "give an output in a folder this user can write to"
        name = f"{label} {given}"
    else:
        folder, variable = default_cache_root()
        label = variable or "the cache folder"
        name = f"{label} {folder}" + ("" if variable else f" (${CACHE_VARIABLE} is not set)")
        advice = f"{'point' if variable else 'set'} {CACHE_VARIABLE} to a folder this user can write to, or give " \
                 f"{cache_flag}"
    folder = check_output_dir(folder, label)
    if folder.is_dir():
        return
    existing = next(p for p in (folder, *folder.parents) if os.path.lexists(p))
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".dpr-gc-probe-", dir=existing))
    except OSError as e:  # any refusal: procfs says "no such file or directory" in a folder that exists
        reason = (e.strerror or os.strerror(e.errno) if e.errno else str(e)).lower()
        reason = "the file system takes no new files" if e.errno == errno.ENOENT else reason
        raise DprGcError(f"{name} cannot be written: {reason} in {existing}; {advice}") from None


def refused_output(error: OSError, outputs: Mapping[str, Any]) -> Optional[DprGcError]:
    """The one line for an output (``{flag: path or paths}``) the system refuses to create or write in (no
    permission, a read-only file system, a name too long): it names the output's flag and path and the folder that
    refused, not the lock or temporary file beside or inside the output that the refusal came from. None for other
    errors."""
    if not error.filename:
        return None
    where = Path(os.path.abspath(os.fsdecode(error.filename)))
    reason = (error.strerror or os.strerror(error.errno)).lower()
    if error.errno == errno.ENOENT and refuses_new_files(where.parent):  # procfs: "no such file" in a folder
        reason = "the file system takes no new files"
    elif error.errno not in REFUSED_ERRNOS:
        return None
    for flag, value in outputs.items():
        for path in _paths(value):
            out = Path(os.path.abspath(path))
            if where == out or written_beside(where, out) or out in where.parents or where in out.parents:
                advice = ("give a shorter name" if error.errno == errno.ENAMETOOLONG else
                          "give an output in a folder this user can write to")
                return DprGcError(f"{flag} {path} cannot be written: {reason} in {where.parent}; {advice}")
    return None


def refuses_new_files(folder: Path) -> bool:
    """Whether ``folder`` exists and no file can be made in it (a temporary file made and removed tells): procfs
    answers "No such file or directory" for a new file in a folder that exists."""
    if not folder.is_dir():
        return False
    try:
        fd, probe = tempfile.mkstemp(prefix=".dpr-gc-probe-", dir=folder)
    except OSError:
        return True
    os.close(fd)
    os.unlink(probe)
    return False


@contextlib.contextmanager
def streams_copied(args: Any, dests: Sequence[str]) -> Iterator[None]:
    """For the block, replace each input of ``args`` (destinations ``dests``) that is a pipe or device (``<(...)``,
    ``/dev/stdin``, ``/dev/null``) by a temporary copy (:func:`~dpr_gc.base.files.spooled`); an error message or log
    line that names a copy names the input given instead (what the stage records names it too:
    :func:`~dpr_gc.base.files.copied_from`)."""
    given = {dest: getattr(args, dest, None) for dest in dests}
    with spooled(p for value in given.values() for p in _paths(value)) as copies:
        if not copies:
            yield
            return
        for dest, value in given.items():
            if isinstance(value, (list, tuple)):
                setattr(args, dest, type(value)(str(copies.get(Path(v), v)) for v in value))
            elif value is not None and Path(os.fspath(value)) in copies:
                setattr(args, dest, str(copies[Path(os.fspath(value))]))
        names = {spelt: str(stream) for stream, copy in copies.items()
                 for spelt in (str(copy), os.path.realpath(copy))}

        def given_names(message: str) -> str:
            for spelt in sorted(names, key=len, reverse=True):
                message = message.replace(spelt, names[spelt])
            return message

        try:
            with messages_rewritten(given_names):
                yield
        finally:
            for dest, value in given.items():
                setattr(args, dest, value)


# --------------------------------------------------------------------------------------------- whole folders
@contextlib.contextmanager
def atomic_folder(path: PathLike) -> Iterator[Path]:
    """Yield a new temporary folder beside ``path``; when the block succeeds it replaces ``path`` (rename into place,
    the old folder moved aside first and then deleted), otherwise it is deleted. A kill at any moment leaves the old
    folder or none under ``path`` (plus a hidden ``.NAME.*.new`` or ``.old`` sibling, which the next run on that output
    deletes: :func:`remove_stale_folders`), never a half-written one.

    An existing ``path`` that is a file is refused before anything is written; a symbolic link stays one, its target
    is replaced.
    """
    final = output_target(path, "output")
    if final.exists() and not final.is_dir():
        raise DprGcError(f"{final} is a file; give a folder")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=beside(final, ".").name, suffix=".new", dir=final.parent))
    os.chmod(tmp, 0o777 & ~_umask())
    try:
        try:
            yield tmp
        except Exception as e:
            if is_disk_full(e):
                raise DiskFullError(final) from None
            raise
        old = None
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".old", dir=final.parent))
            os.rmdir(old)
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def remove_stale_folders(parent: PathLike, name: str) -> list[Path]:
    """Delete the ``.NAME.*.new`` / ``.NAME.*.old`` folders a killed :func:`atomic_folder` left (call it holding the
    lock that guards ``NAME``)."""
    removed = []
    root = Path(parent)
    if root.is_dir():
        for suffix in (".new", ".old"):
            for stale in root.glob(f".{name}.*{suffix}"):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
                    removed.append(stale)
    return removed
