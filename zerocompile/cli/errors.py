"""``CliError``: a problem the ``zerocompile`` command reports as one line on stderr (the CLI's
own error class; the package's user-facing errors are in ``zerocompile/errors.py``)."""

from __future__ import annotations


class CliError(Exception):
    """A problem the command reports as one line on stderr, exiting with ``code``."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(" ".join(str(message).split()))
        self.code = code
