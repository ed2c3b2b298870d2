"""sha256 of files, streamed (wheels are ~130 MB; no whole-file reads)."""
from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path
from typing import Any

from kmesh.sources import HashMismatchError

_CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def verify_file(path: str | os.PathLike[str], expected: str, pinned_by: str = "the lock") -> str:
    """Return the file's sha256 if it equals `expected`, else raise HashMismatchError naming both."""
    actual = sha256_file(path)
    if actual != expected.lower():
        raise HashMismatchError(str(path), expected.lower(), actual, pinned_by)
    return actual


def record_digest(data: bytes) -> str:
    """A wheel RECORD's digest form: 'sha256=' + urlsafe base64 without padding (PEP 376/427)."""
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def file_record_digest(path: Path) -> str:
    return record_digest(path.read_bytes())


def sha256_tensor(t: Any) -> str:
    """sha256 of a tensor's raw bytes in memory order after .contiguous() (any device; torch is not imported)."""
    return hashlib.sha256(t.detach().contiguous().cpu().numpy().tobytes()).hexdigest()
