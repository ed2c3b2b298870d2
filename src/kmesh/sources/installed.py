"""What the running interpreter has installed for a pinned distribution, compared with the pinned wheel."""
from __future__ import annotations

import hashlib
import importlib.util
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def module_origin(module: str) -> Path | None:
    """Where `import module` would load from, found without importing it (top-level names only)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve()


def module_from_dist(dist: str, module: str) -> bool:
    """True when `import module` resolves to a file the installed `dist` owns (not a shadowing copy)."""
    origin = module_origin(module)
    d = metadata.distribution(dist)
    return origin is not None and any(Path(d.locate_file(f)).resolve() == origin for f in d.files or [])


@dataclass
class FileComparison:
    compared: int = 0
    missing: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return self.compared > 0 and not self.missing and not self.different


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def compare_installed(dist: str, unpacked_root: Path, sources: tuple[str, ...]) -> FileComparison:
    """Every unpacked source file against the installed file at the same wheel-relative path."""
    d = metadata.distribution(dist)
    out = FileComparison()
    for rel in sources:
        if rel.split("/", 1)[0].endswith(".dist-info"):
            continue    # the installer rewrites RECORD/INSTALLER; metadata is not source
        inst = Path(d.locate_file(rel))
        out.compared += 1
        if not inst.is_file():
            out.missing.append(rel)
        elif _sha(inst) != _sha(unpacked_root / rel):
            out.different.append(rel)
    return out
