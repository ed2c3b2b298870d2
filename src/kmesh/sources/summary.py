"""results/sources/pins.json: the pinned serving stack as the sources stage found it, for other stages
and the report to read (one file per results dir; both profiles pin the same lock)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from kmesh.jsonfile import read_json_schema, write_json_atomic
from kmesh.sources import SourcesError

SCHEMA = "kmesh.pins/1"


def pins_path(results_dir: Path) -> Path:
    return results_dir / "sources" / "pins.json"


def write_pins(path: Path, summary: dict[str, Any]) -> None:
    """Atomically write the summary (temp file + rename)."""
    write_json_atomic(path, {"schema": SCHEMA, **summary}, sort_keys=True)


def read_pins(path: Path) -> dict[str, Any]:
    """The summary the sources stage wrote; SourcesError if absent or of another schema."""
    return read_json_schema(path, SCHEMA, SourcesError, "pins summary")
