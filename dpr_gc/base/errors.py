"""One exception type for mistakes a user can fix: bad files, bad lines, bad flags."""


class DprGcError(ValueError):
    """A user-facing error (a ValueError, so library callers can treat it as one). The message is one line that names the file, line or flag and what to do.

    The CLI prints it as ``error: <message>`` and exits with status 2; library callers can catch it.
    """
