"""results/sources/pins.json: the pinned serving stack as the sources stage found it, for other stages
and the report to read (one file per results dir; both profiles pin the same lock)."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kmesh.sources import SourcesError

SCHEMA = "kmesh.pins/1"


def pins_path(results_dir: Path) -> Path:
    return results_dir / "sources" / "pins.json"


def write_pins(path: Path, summary: dict[str, Any]) -> None:
    """Atomically write the summary (temp file + rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        json.dump({"schema": SCHEMA, **summary}, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def read_pins(path: Path) -> dict[str, Any]:
    """The summary the sources stage wrote; SourcesError if absent or of another schema."""
    if not path.is_file():
        raise SourcesError(f"pins summary not found: {path} (run the sources stage first)")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SourcesError(f"pins summary {path} is not JSON: {e}") from e
    if data.get("schema") != SCHEMA:
        raise SourcesError(f"pins summary {path} has schema {data.get('schema')!r}, expected {SCHEMA!r}")
    return data
