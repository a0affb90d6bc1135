"""The one exception type the CLI turns into a one-line message and exit status 2."""


class UsageError(Exception):
    """Bad input from the user: a flag value, a file, a name.

    The message must name the bad value and say how to fix it; the CLI prints it
    on one line, without a traceback, and exits 2.
    """
