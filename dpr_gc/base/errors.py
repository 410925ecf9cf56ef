"""One exception type for mistakes a user can fix (bad files, bad lines, bad flags), and the wrapper that turns it
into one ``error:`` line and exit status 2 for every command (``dpr-gc``, the DPR-compatible scripts, the JAX example)."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import re
import sys
from typing import Any, Callable, Iterator, Mapping, Optional


class DprGcError(ValueError):
    """A user-facing error (a ValueError, so library callers can treat it as one). The message is one line that names the file, line or flag and what to do.

    The CLI prints it as ``error: <message>`` and exits with status 2; library callers can catch it. ``alike`` says
    whether every rank of a torchrun launch raises it alike (the same command line and files): then one rank per
    machine prints it (:func:`report_errors`). None (not known) and False (this rank's own) print on every rank.
    """

    alike: Optional[bool] = None


class DiskFullError(DprGcError):
    """No space was left (or the quota or file size limit was reached) while writing ``path``; whatever was being
    written there is removed, and the previous version, if any, is kept."""

    def __init__(self, path: Any, advice: str = "free space or write somewhere else, then run the command again") -> None:
        self.path = path
        super().__init__(f"{path}: the disk is full (or a quota or file-size limit was reached) while writing it; "
                         f"nothing half-written is left and any earlier version is kept; {advice}")


FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
# A quoted dpr-gc command line in a message (`dpr-gc encode --output DIR` or 'dpr-gc index ...'): its flags are
# that command's own and stay as they are whoever shows the message.
COMMAND = re.compile(r"(`|')dpr-gc [^`']*\1")


def rename_flags(message: str, names: Mapping[str, str]) -> str:
    """``message`` with each flag of ``names`` spelt as its value, except inside quoted ``dpr-gc`` commands."""
    def rename(text: str) -> str:
        return FLAG.sub(lambda m: names.get(m.group(0), m.group(0)), text)

    out, end = [], 0
    for command in COMMAND.finditer(message):
        out += [rename(message[end:command.start()]), command.group(0)]
        end = command.end()
    return "".join(out + [rename(message[end:])])


def clipped(text: str, limit: int = 60) -> str:
    """``text`` quoted for a message, cut to ``limit`` characters with its length said where it is longer: a bad
    line of a one-line file (a megabyte of JSON) must not make the error line as long."""
    return repr(text) if len(text) <= limit else f"{text[:limit]!r}... ({len(text):,} characters)"


def setting_text(value: Any) -> str:
    """A setting's value as a message about a changed setting shows it (``--top-k 20 -> 10``, ``--dev (not set) ->
    'dev/'``): ``(not set)`` for None, ``(absent)`` for a value a record lacks (``dataclasses.MISSING``), else its
    repr."""
    if value is None:
        return "(not set)"
    return "(absent)" if value is dataclasses.MISSING else repr(value)


def reworded(error: DprGcError, message: str) -> DprGcError:
    """A :class:`DprGcError` saying ``message`` in place of ``error``, raised as alike on every rank as it was."""
    new = DprGcError(message)
    new.alike = error.alike
    return new


@contextlib.contextmanager
def alike_on_every_rank() -> Iterator[None]:
    """Within the block, a :class:`DprGcError` not known otherwise is one every rank of a torchrun launch raises alike:
    for refusals that follow from the command line and the files alone (flags, inputs, outputs, settings, the
    data's size), which every rank checks the same way, so one line per machine says it, not one per rank."""
    try:
        yield
    except DprGcError as e:
        if e.alike is None:
            e.alike = True
        raise


def shown_by_another_rank() -> bool:
    """Whether this process is a torchrun rank other than its machine's first (``LOCAL_RANK`` above 0): a refusal
    every rank reaches alike, or an interrupt every rank receives, is printed by that first rank, not by this one."""
    world, local = (os.environ.get(name) or "" for name in ("WORLD_SIZE", "LOCAL_RANK"))  # not numbers: refused later
    return world.strip().isdigit() and int(world) > 1 and local.strip().isdigit() and int(local) > 0


@contextlib.contextmanager
def messages_rewritten(rewrite: Callable[[str], str]) -> Iterator[None]:
    """Within the block, every log line (of any level) and every :class:`DprGcError` message says
    ``rewrite(text)`` in place of its text: code below a command names what it was handed, and the command knows
    what the user typed for it (:func:`flags_renamed`, an input copied from a pipe)."""
    make_record = logging.getLogRecordFactory()

    def rewritten_record(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make_record(*args, **kwargs)
        try:
            message = record.getMessage()
        except Exception:  # arguments that do not fit the format: logging reports them as it emits the line
            return record
        rewritten = rewrite(message)
        if rewritten != message:
            record.msg, record.args = rewritten, ()
        return record

    logging.setLogRecordFactory(rewritten_record)
    try:
        yield
    except DprGcError as e:
        raise reworded(e, rewrite(str(e))) from None
    finally:
        logging.setLogRecordFactory(make_record)


@contextlib.contextmanager
def flags_renamed(names: Mapping[str, str]) -> Iterator[None]:
    """Within the block, a :class:`DprGcError` and a log line name each flag of ``names`` as its value. Code that
    several commands share names its own command's flags (encode's ``--output``), which another command reaching it
    spells otherwise or lacks (mine's encode writes to its ``--embeddings``; the DPR scripts spell flags as DPR
    does). A quoted ``dpr-gc`` command in the message (advice to run one) keeps that command's own flags."""
    with messages_rewritten(lambda message: rename_flags(message, names)):
        yield


@contextlib.contextmanager
def model_named_by(flag: str, model: Optional[str]) -> Iterator[None]:
    """Within the block, a :class:`DprGcError` about the model ``model`` (the model layer's "model 'X'", as a library
    caller passes it) names it by the ``flag`` it came from ("--model 'X'"); a ``model`` None changes nothing."""
    try:
        yield
    except DprGcError as e:
        if not model or f"model {model!r}" not in str(e):
            raise
        raise reworded(e, str(e).replace(f"model {model!r}", f"{flag} {model!r}", 1)) from None


class Interrupted(KeyboardInterrupt):
    """An interrupt after which a command has kept finished work: its message says what and how to resume, in
    place of :data:`NOTHING_KEPT`."""


# What an interrupt prints where the command names no kept work of its own (outputs appear whole or not at all).
NOTHING_KEPT = "nothing half-written is left; run the same command again (it reuses any output it had finished)"
NOTHING_STARTED = "stopped while the command was loading; nothing was written"


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "File too large", "os error 28")


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` says the disk (or quota) is full: an ``OSError`` with ENOSPC/EDQUOT/EFBIG, a
    :class:`DiskFullError`, or a library's error that carries the system's words (FAISS, safetensors)."""
    if isinstance(error, DiskFullError) or (isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS):
        return True
    return not isinstance(error, DprGcError) and any(word in str(error) for word in DISK_FULL_WORDS)


# What gloo and NCCL say when the other end of a collective is gone (its process failed, was interrupted or killed).
LOST_PEER_WORDS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                   "NCCL communicator was aborted")


def say(line: str) -> None:
    """Write ``line`` and its newline to stderr in one write: stderr into a pipe is unbuffered, so ``print`` writes
    the text and the newline apart, and under torchrun another rank's line could land between them (one line glued
    onto another, the next left empty)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def lost_a_peer(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure because another rank of a multi-process job stopped: then that rank
    has printed the reason, and this one's traceback (dozens of lines from every surviving rank) would bury it."""
    if int(os.environ.get("WORLD_SIZE") or 1) <= 1 or not isinstance(error, RuntimeError):
        return False
    distributed = sys.modules.get("torch.distributed")
    dist_error = getattr(distributed, "DistError", None)
    return (dist_error is not None and isinstance(error, dist_error)) or any(w in str(error) for w in LOST_PEER_WORDS)


# The short reasons a lost peer's line keeps from gloo's or NCCL's message (its source path, address and advice go).
LOST_PEER_REASONS = {"connection reset by peer": "connection reset by peer",
                     "connection closed by peer": "connection closed by peer", "broken pipe": "broken pipe",
                     "nccl communicator was aborted": "NCCL communicator was aborted", "timed out": "timed out"}


def lost_peer_line(error: BaseException) -> str:
    """The one line a rank prints when its collective lost another rank (:func:`lost_a_peer`): that it stopped too,
    with a short reason when the library's message names one ("connection reset by peer"), never its raw text."""
    text = str(error).lower()
    reason = next((short for words, short in LOST_PEER_REASONS.items() if words in text), None)
    return ("error: another rank of this job stopped (its own message says why); this rank stopped too"
            + (f" ({reason})" if reason else ""))


def os_error_line(error: OSError) -> str:
    """The one ``error:`` line for an ``OSError``: the path(s) it names, if any, what the system said, and advice
    that fits it (free space only when the disk or quota is full)."""
    names = [os.fsdecode(n) if isinstance(n, (str, bytes, os.PathLike)) else str(n)
             for n in (error.filename, error.filename2) if n not in (None, "")]
    where = f"{' -> '.join(names)}: " if names else ""
    reason = error.strerror or (os.strerror(error.errno) if error.errno else str(error).strip()) or type(error).__name__
    if is_disk_full(error):
        advice = "free space or write somewhere else, then run the command again"
    else:
        advice = "check the path" if names else "check the paths and folders the command was given"
    return f"error: {where}{reason}; {advice}"


def report_errors(action: Callable[[], Any]) -> int:
    """Run ``action`` as a command: a :class:`DprGcError` (or an ``OSError``, e.g. a full disk) becomes one
    ``error: ...`` line on stderr and exit status 2, a collective that lost another rank of the job one line too
    (:func:`lost_a_peer`), an interrupt exit status 130; an int result is the exit status, anything else 0. Under
    torchrun a refusal every rank reaches alike (``DprGcError.alike``) and the interrupt notice are printed by each
    machine's first rank only (the others exit silently with the same status)."""
    try:
        result = action()
    except RuntimeError as e:
        if not lost_a_peer(e):
            raise
        say(lost_peer_line(e))
        return 2
    except DprGcError as e:
        if not (e.alike and shown_by_another_rank()):
            say("error: " + " ".join(str(e).splitlines()))
        return 2
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in JSON) reached a UTF-8 output
        say(f"error: the input holds text that is not valid Unicode ({ascii(e.object[e.start:e.end])}, a lone "
            "surrogate from a JSON escape); fix or remove it in the input file")
        return 2
    except OSError as e:  # refused by the OS: permissions, a full disk, a folder where a file belongs
        say(os_error_line(e))
        return 2
    except KeyboardInterrupt as e:
        advice = str(e) if isinstance(e, Interrupted) and str(e) else NOTHING_KEPT
        if not shown_by_another_rank():
            say(f"interrupted: {advice}")
        return 130
    return result if isinstance(result, int) else 0
