"""The command-line tools' shared edge: user errors become one line and exit code 2.

Every ``tools/*.py`` calls ``run(main)``. The package's own errors (``DFlashCBError``) and OS
errors on user paths (an unwritable ``--out``, a file where a folder is expected, a full disk)
print ``error: <what, where> (<fix>)`` on stderr, no traceback. Anything else is a bug in this
package and keeps its traceback.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable, Sequence

from .errors import DFlashCBError

EXIT_USER_ERROR = 2

_OS_FIXES = {
    errno.ENOSPC: "free disk space or choose another folder, then rerun the same command",
    errno.EDQUOT: "free disk space or choose another folder, then rerun the same command",
    errno.EFBIG: "the file outgrew the size limit (ulimit -f) or the filesystem's largest file: raise the limit or "
                 "choose another folder, then rerun the same command",
    errno.EACCES: "choose a path you can write to, or fix its permissions",
    errno.EPERM: "choose a path you can write to, or fix its permissions",
    errno.EROFS: "the filesystem is read-only: choose another path",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a file stands where a folder is expected: choose another path",
    errno.EISDIR: "a folder stands where a file is expected: choose another path",
    errno.EEXIST: "remove it or choose another path",
}


def describe_os_error(err: OSError) -> str:
    """``<path>: <reason> (<fix>)`` for an OS error, naming both paths of a failed rename."""
    where = " -> ".join(str(p) for p in (err.filename, err.filename2) if p is not None)
    reason = err.strerror or str(err)
    fix = _OS_FIXES.get(err.errno or -1)
    text = f"{where}: {reason}" if where else reason
    return f"{text} ({fix})" if fix else text


def run(main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Call ``main(argv)``; turn user errors into one stderr line and exit code 2.

    Set ``DFLASH_CB_TRACEBACK=1`` to get the full traceback instead (for bug reports).
    """
    try:
        return int(main(argv) or 0)
    except (DFlashCBError, OSError) as e:
        if os.environ.get("DFLASH_CB_TRACEBACK"):
            raise
        text = describe_os_error(e) if isinstance(e, OSError) else str(e)
        print(f"error: {text}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
