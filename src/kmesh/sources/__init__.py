"""The pinned serving stack as files: fetch each pinned distribution, verify its sha256 against the
hash lock, unpack its Python sources for reading, and compare it with what is installed.

    fetch.py      the cached-or-downloaded distribution file (pip download, never an unverified cache hit)
    digest.py     sha256 of files, and the one mismatch error every caller raises
    unpack.py     a wheel's Python sources under a folder, each file checked against the wheel's RECORD
    installed.py  the installed distribution: version, module location, files equal to the wheel's
"""
from __future__ import annotations

from kmesh.errors import KMeshError


class SourcesError(KMeshError):
    """A pinned distribution could not be fetched, verified, unpacked or matched."""


class HashMismatchError(SourcesError):
    """A file's sha256 is not the one the lock pins; the message names the file and both digests."""

    def __init__(self, path: str, expected: str, actual: str, pinned_by: str = "the lock") -> None:
        super().__init__(f"sha256 mismatch for {path}: expected {expected} ({pinned_by}), got {actual}")
        self.path, self.expected, self.actual = path, expected, actual


class NetworkUnavailableError(SourcesError):
    """The package index cannot be reached and no verified file is cached."""
