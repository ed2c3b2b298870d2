"""Errors of the storage layer: one class per way an object file can be unusable.

Every one is a StorageError; a reader that catches StorageError knows the bytes were NOT used.
"""
from __future__ import annotations

from kmesh.errors import KMeshError


class StorageError(KMeshError):
    """Root of storage failures: the object (or the route) could not deliver verified bytes."""


class ObjectNotFoundError(StorageError):
    """No object file at the path (never written, or removed)."""


class BadMagicError(StorageError):
    """The file does not start with the KMesh object magic: not an object file."""


class BadVersionError(StorageError):
    """An object file of a format version this build does not read."""


class HeaderCorruptError(StorageError):
    """The header's own checksum or encoding is wrong (bit rot, a torn write of the header)."""


class HeaderLieError(StorageError):
    """The header is well formed but its sizes are impossible or disagree with the file on disk."""


class ShortFileError(StorageError):
    """The file is shorter than its header says (truncated), or a read returned fewer bytes."""


class ObjectCorruptError(StorageError):
    """The payload does not hash to the digest recorded in the header."""


class ObjectAlgorithmError(StorageError):
    """The header names an integrity algorithm (or parameters) this build cannot check."""


class ObjectReplacedError(StorageError):
    """The file was replaced or modified while it was open: what was read may not be what the path now holds."""


class ObjectMismatchError(StorageError):
    """The object is intact but is not the one asked for (another key or size than the catalog's)."""


class RouteUnavailableError(StorageError):
    """A storage route cannot run on this machine (no CUDA, no cuFile, no O_DIRECT); the reason says why."""


class RouteIOError(StorageError):
    """A read through a route failed (an errno, or the device copy did not complete)."""
