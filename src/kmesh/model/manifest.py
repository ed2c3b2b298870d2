"""manifest.json of a converted model folder: what it was made from and the digest of every file.

The manifest is written last, so a folder without one is an unfinished conversion. A cached folder is
reused only when its manifest names the same source and versions and every file still has its digest.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from kmesh.sources.digest import sha256_file

SCHEMA = "kmesh.model-manifest/1"
NAME = "manifest.json"


def folder_files(folder: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {sha256, bytes}} of every file in `folder` but the manifest."""
    return {str(p.relative_to(folder)): {"sha256": sha256_file(p), "bytes": p.stat().st_size}
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != NAME}


def write_manifest(folder: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Hash the folder's files and write the manifest atomically; returns it."""
    manifest = {"schema": SCHEMA, **info, "files": folder_files(folder)}
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{NAME}.")
    with os.fdopen(fd, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, folder / NAME)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((folder / NAME).read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("schema") == SCHEMA else None


def manifest_problem(folder: Path, expect: dict[str, Any]) -> str | None:
    """None if the folder is a complete conversion of what `expect` describes, else why it is not."""
    m = read_manifest(folder)
    if m is None:
        return f"no valid {NAME} in {folder}"
    for key, want in expect.items():
        if m.get(key) != want:
            return f"{key} differs: manifest has {m.get(key)!r}, now {want!r}"
    files = m.get("files") or {}
    if not files:
        return f"{NAME} in {folder} lists no files"
    for rel, meta in files.items():
        p = folder / rel
        if not p.is_file():
            return f"{p} is missing"
        if p.stat().st_size != meta["bytes"] or sha256_file(p) != meta["sha256"]:
            return f"{p} changed since conversion (manifest sha256 {meta['sha256']})"
    return None
