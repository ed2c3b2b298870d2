"""A wheel's Python sources unpacked for reading, every file checked against the wheel's own RECORD.

Only sources are extracted (*.py, *.pyi and the .dist-info metadata); compiled extensions stay in the
wheel. Unpacking goes to a temporary sibling folder that replaces the destination only when complete, and
a marker names the wheel digest it came from, so a rerun re-verifies the files instead of re-extracting.
"""
from __future__ import annotations

import csv
import io
import json
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kmesh.sources import SourcesError
from kmesh.sources.digest import file_record_digest, record_digest

SOURCE_SUFFIXES = (".py", ".pyi")
MARKER = ".kmesh-unpacked.json"


@dataclass(frozen=True)
class Unpacked:
    root: Path
    files: tuple[str, ...]     # wheel-relative paths of the extracted files
    reused: bool               # True: already unpacked from this wheel digest; files were re-verified

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(f for f in self.files if f.endswith(SOURCE_SUFFIXES))


def _is_source(name: str) -> bool:
    parts = PurePosixPath(name).parts
    return not name.endswith("/") and (name.endswith(SOURCE_SUFFIXES) or parts[0].endswith(".dist-info"))


def _check_name(wheel: Path, name: str) -> None:
    p = PurePosixPath(name)
    if p.is_absolute() or ".." in p.parts or "\\" in name:
        raise SourcesError(f"{wheel}: member {name!r} would unpack outside the destination")


def read_record(zf: zipfile.ZipFile, wheel: Path) -> dict[str, str]:
    """{path: 'sha256=…'} from the wheel's .dist-info/RECORD ('' for RECORD itself)."""
    records = [n for n in zf.namelist() if n.count("/") == 1 and n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise SourcesError(f"{wheel}: expected one .dist-info/RECORD, found {records}")
    rows = csv.reader(io.StringIO(zf.read(records[0]).decode()))
    return {row[0]: row[1] for row in rows if row}


def _expected(record: dict[str, str], name: str, wheel: Path) -> str:
    if name not in record:
        raise SourcesError(f"{wheel}: {name} is not listed in the wheel's RECORD")
    return record[name]


def unpack_sources(wheel: Path, wheel_sha256: str, dest: Path) -> Unpacked:
    """Extract the Python sources of `wheel` under `dest` (kept as is if already unpacked from this digest).

    Each member is checked against the wheel's RECORD before it is written; `verify_unpacked` checks
    what is on disk afterwards.
    """
    with zipfile.ZipFile(wheel) as zf:
        record = read_record(zf, wheel)
        names = sorted(n for n in zf.namelist() if _is_source(n))
        for n in names:
            _check_name(wheel, n)
        marker = dest / MARKER
        if marker.is_file():
            try:
                old = json.loads(marker.read_text())
            except json.JSONDecodeError:
                old = {}
            if old.get("wheel_sha256") == wheel_sha256 and old.get("files") == names:
                return Unpacked(dest, tuple(names), reused=True)
        tmp = dest.parent / f".{dest.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for n in names:
            data = zf.read(n)
            want = _expected(record, n, wheel)
            if want and record_digest(data) != want:
                raise SourcesError(f"{wheel}: member {n} has {record_digest(data)}, its RECORD says {want}")
            out = tmp / n
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(data)
    (tmp / MARKER).write_text(json.dumps({"wheel": wheel.name, "wheel_sha256": wheel_sha256, "files": names}))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(tmp, dest)
    return Unpacked(dest, tuple(names), reused=False)


def verify_unpacked(wheel: Path, unpacked: Unpacked) -> tuple[int, list[str]]:
    """Hash every unpacked file on disk against the wheel's RECORD: (files verified, files that differ or
    are missing). RECORD itself carries no digest and is not counted."""
    with zipfile.ZipFile(wheel) as zf:
        record = read_record(zf, wheel)
    verified, bad = 0, []
    for n in unpacked.files:
        want = _expected(record, n, wheel)
        if not want:
            continue
        p = unpacked.root / n
        if not p.is_file() or file_record_digest(p) != want:
            bad.append(n)
        verified += 1
    return verified, bad
