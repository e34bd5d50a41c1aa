"""Integrity of cache files: sha256, the identity of a file on disk, and the files this process verified.

A cache is checked against its manifest's sha256 once per file and process: a file that matched is
hashed again only when its identity (``file_identity``) changed, so every Lightning ``setup`` (a new
``StateCache`` of the same folder) and every evaluation cost one ``stat`` per file, not a re-read.
"""

from __future__ import annotations

import hashlib
import os


def file_identity(st: os.stat_result) -> tuple[int, ...]:
    """What tells a file apart from its earlier self: device, inode, size, modification and status-change time.

    The one statement of the rule every "the file changed" check in this package uses. Any rewrite,
    copy or replacement changes one of them: a copy or a rename brings another inode, and a rewrite
    that keeps (or restores) the modification time still changes the status-change time. Only bytes
    changed with none of these (a disk's silent corruption) go unnoticed until the next full hash.
    """
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


class VerifiedFiles:
    """Files whose sha256 matched, by (real path, ``file_identity``, expected sha256)."""

    def __init__(self) -> None:
        self._keys: set[tuple[str, tuple[int, ...], str]] = set()

    @staticmethod
    def _key(path: str | os.PathLike, st: os.stat_result, expected: str) -> tuple[str, tuple[int, ...], str]:
        return os.path.realpath(path), file_identity(st), expected

    def holds(self, path: str | os.PathLike, st: os.stat_result, expected: str) -> bool:
        """``path``, as ``st`` describes it, matched ``expected`` before."""
        return self._key(path, st, expected) in self._keys

    def add(self, path: str | os.PathLike, expected: str, st: os.stat_result | None = None) -> None:
        """Record that ``path`` (as ``st`` describes it; as it is now by default) matches ``expected``."""
        self._keys.add(self._key(path, os.stat(path) if st is None else st, expected))

    def clear(self) -> None:
        """Forget every file: each is hashed again at its next check."""
        self._keys.clear()


# One per process: what one reader verified, the next reader of the same file does not hash again.
VERIFIED = VerifiedFiles()


def sha256_unless_verified(path: str | os.PathLike, st: os.stat_result, expected: str) -> str | None:
    """The sha256 of ``path``, or None when this process found it equal to ``expected`` before and its
    identity is unchanged since; a file that matches is recorded in ``VERIFIED``."""
    if VERIFIED.holds(path, st, expected):
        return None
    digest = sha256_file(path)
    if digest == expected:
        VERIFIED.add(path, expected, st)
    return digest
