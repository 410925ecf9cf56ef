"""One exception type for mistakes a user can fix (bad files, bad lines, bad flags), and the wrapper that turns it
into one ``error:`` line and exit status 2 for every command (``dpr-gc``, the DPR-compatible scripts, the JAX example)."""

from __future__ import annotations

import sys
from typing import Any, Callable


class DprGcError(ValueError):
    """A user-facing error (a ValueError, so library callers can treat it as one). The message is one line that names the file, line or flag and what to do.

    The CLI prints it as ``error: <message>`` and exits with status 2; library callers can catch it.
    """


def report_errors(action: Callable[[], Any]) -> int:
    """Run ``action`` as a command: a :class:`DprGcError` (or an ``OSError``, e.g. a full disk) becomes one
    ``error: ...`` line on stderr and exit status 2, an interrupt exit status 130; an int result is the exit status,
    anything else 0."""
    try:
        result = action()
    except DprGcError as e:
        print("error: " + " ".join(str(e).splitlines()), file=sys.stderr)
        return 2
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800" in JSON) reached a UTF-8 output
        print(f"error: the input holds text that is not valid Unicode ({ascii(e.object[e.start:e.end])}, a lone "
              "surrogate from a JSON escape); fix or remove it in the input file", file=sys.stderr)
        return 2
    except OSError as e:  # refused by the OS: permissions, a full disk, a folder where a file belongs
        where = f"{e.filename}: " if e.filename else ""
        print(f"error: {where}{e.strerror or e}; check the path and free space", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: finished work is kept; run the same command again to resume", file=sys.stderr)
        return 130
    return result if isinstance(result, int) else 0
