"""Versioned JSON files: atomic write (temp + rename) and schema-checked read, for every file KMesh writes."""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def write_json_atomic(path: str | os.PathLike[str], data: Any, *, sort_keys: bool = False) -> Path:
    """Write JSON so a reader never sees a half-written file; NaN/inf are refused (not valid JSON)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.")
    try:
        # mkstemp creates 0600; results are meant to be read by others (the report, a web server, a colleague).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o644 & ~umask)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False, sort_keys=sort_keys)
            f.write("\n")
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def read_json_schema(path: str | os.PathLike[str], schema: str, error: type[Exception], what: str) -> dict[str, Any]:
    """Read a JSON object whose "schema" field must equal `schema`; raise `error` naming the file otherwise."""
    p = Path(path)
    if not p.is_file():
        raise error(f"{what} not found: {p}")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise error(f"{what} {p} is not JSON: {e}") from e
    found = data.get("schema") if isinstance(data, dict) else None
    if found != schema:
        raise error(f"{what} {p} has schema {found!r}, expected {schema!r}")
    return data
