"""The hash lock (requirements/*.lock): pinned distributions, versions and sha256 digests."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kmesh.errors import KMeshError


class LockError(KMeshError):
    """The lock file is missing or malformed."""


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    sha256: str


_LINE = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+)==(?P<ver>\S+)\s+--hash=sha256:(?P<sha>[0-9a-f]{64})\s*$")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path) -> dict[str, Pin]:
    if not path.is_file():
        raise LockError(f"lock file not found: {path}")
    pins: dict[str, Pin] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise LockError(f"{path}:{n}: expected 'name==version --hash=sha256:<64 hex>', got {line!r}")
        name = canonical(m["name"])
        pins[name] = Pin(name, m["ver"], m["sha"])
    return pins
