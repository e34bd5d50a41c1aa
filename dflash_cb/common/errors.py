"""One base class for every error this package raises on purpose.

A ``DFlashCBError`` is a user's problem (a bad path, a damaged cache, a mismatched drafter): its
message names the file or value and the fix, and the command-line tools print it as one line
(``dflash_cb.common.cli.run``) instead of a traceback. Anything else escaping a tool is our bug.
"""

from __future__ import annotations


class DFlashCBError(Exception):
    """Base class of the package's own errors; the message is written for the user."""
