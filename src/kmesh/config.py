"""Load, merge and validate the pipeline configuration.

One source of truth for Snakemake and for `python -m kmesh run`: config/config.yaml, overlaid with
config/profiles/<profile>.yaml, validated against config/config.schema.yaml.

Skips are allowed per stage and per profile: `<stage>.allow_skips` in config/profiles/<profile>.yaml lists
case-id globs with the reason each skip is acceptable there (Config.skip_allowances; kmesh.result applies them).
"""
from __future__ import annotations

import copy
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

import jsonschema
import yaml

from kmesh.errors import ConfigError

PROFILES = ("cpu", "cuda")
ALLOW_SKIPS = "allow_skips"


@dataclass(frozen=True)
class SkipAllowance:
    """One accepted skip: case ids matching the glob `case` may be skipped, because of `reason`."""

    case: str
    reason: str


def find_root(start: Path | None = None) -> Path:
    """The project root: $KMESH_ROOT, else the nearest directory above `start` (cwd) holding config/config.yaml."""
    env = os.environ.get("KMESH_ROOT")
    if env:
        return Path(env).resolve()
    here = (start or Path.cwd()).resolve()
    for d in (here, *here.parents):
        if (d / "config" / "config.yaml").is_file():
            return d
    raise ConfigError(f"no config/config.yaml found in {here} or above; run from the KMesh checkout or set KMESH_ROOT")


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Overlay `over` onto `base`: mappings merge recursively, everything else is replaced."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`--set a.b=value` items (value parsed as YAML) -> the nested dict load_config's `overrides` takes."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set expects KEY=VALUE, got {item!r}")
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def _field_path(err: jsonschema.ValidationError) -> str:
    path = ".".join(str(p) for p in err.absolute_path)
    if err.validator == "additionalProperties" and isinstance(err.instance, dict):
        # Name the unexpected key itself, not only its parent.
        allowed = set(err.schema.get("properties", {}))
        extra = sorted(k for k in err.instance if k not in allowed)
        if extra:
            return ".".join(filter(None, [path, extra[0]]))
    if err.validator == "required":
        return path or "<top level>"
    return path or "<top level>"


def validate(data: Mapping[str, Any], schema_path: Path) -> None:
    """Raise ConfigError naming the first offending field (dotted path) and why."""
    schema = yaml.safe_load(schema_path.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(dict(data)), key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(f"config field '{_field_path(e)}': {e.message}{more}")


@dataclass(frozen=True)
class Config:
    """A validated, merged configuration plus where it came from."""

    data: dict[str, Any]
    root: Path

    @property
    def profile(self) -> str:
        return self.data["profile"]

    @property
    def seed(self) -> int:
        return int(self.data["seed"])

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.data.get(name) or {})

    @property
    def results_dir(self) -> Path:
        p = Path(self.data["results_dir"])
        return p if p.is_absolute() else self.root / p

    def stage_dir(self, stage: str) -> Path:
        """results/<profile>/<stage>/ (created on demand)."""
        d = self.results_dir / self.profile / stage
        d.mkdir(parents=True, exist_ok=True)
        return d

    def path(self, rel: str | os.PathLike[str]) -> Path:
        p = Path(rel)
        return p if p.is_absolute() else self.root / p

    def skip_allowances(self, stage: str) -> tuple[SkipAllowance, ...]:
        """The skips this profile allows stage `stage` (none unless its profile file lists them)."""
        return tuple(SkipAllowance(a["case"], a["reason"]) for a in self.section(stage).get(ALLOW_SKIPS, []))

    def digest(self) -> str:
        """sha256 of the canonical JSON of the merged config: the 'config hash' in provenance."""
        blob = json.dumps(self.data, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()


def _read_mapping(path: Path, what: str) -> dict[str, Any]:
    """A YAML file holding a mapping, or ConfigError naming `what` it is and why not."""
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{what} {path} is not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {path} must hold a mapping at top level")
    return data


def _skip_allowances_in(data: Mapping[str, Any]) -> list[str]:
    return sorted(f"{k}.{ALLOW_SKIPS}" for k, v in data.items() if isinstance(v, dict) and ALLOW_SKIPS in v)


def read_overlay(path: Path) -> dict[str, Any]:
    """A reduced-size overlay (e.g. config/overlays/test.yaml, what `make test` runs): sizes and counts only. It
    may not name the profile or allow skips: only a profile says what its stages may skip."""
    data = _read_mapping(path, "overlay file")
    if "profile" in data or "overlays" in data:
        raise ConfigError(f"overlay {path} may not set 'profile' or 'overlays'")
    allows = _skip_allowances_in(data)
    if allows:
        raise ConfigError(f"config field '{allows[0]}' in overlay {path}: skip allowances are per profile")
    return data


OVERLAYS_DIR = Path("config") / "overlays"


def overlay_file(name: str | os.PathLike[str], root: Path | None = None) -> str:
    """An overlay as given (a path) or by name: `long` is config/overlays/long.yaml. Returned as given where it names
    a file, else as the path relative to the root; an unknown name says which overlays there are."""
    root = root or find_root()
    given = Path(name)
    if (given if given.is_absolute() else root / given).is_file():
        return str(name)
    by_name = OVERLAYS_DIR / f"{name}.yaml"
    if given.suffix == "" and len(given.parts) == 1 and (root / by_name).is_file():
        return str(by_name)
    known = sorted(p.stem for p in (root / OVERLAYS_DIR).glob("*.yaml"))
    raise ConfigError(f"overlay file not found: {name} (an overlay is a file or one of the names {known})")


def load_config(
    profile: str | None = None,
    config_path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    root: Path | None = None,
    overlays: Sequence[str | os.PathLike[str]] = (),
) -> Config:
    """Read config.yaml, overlay the profile file, then each overlay file and `overrides`, validate, return a
    Config. The overlays' paths are kept in the config (`overlays`), so the config hash and every result say so."""
    root = root or find_root()
    path = Path(config_path) if config_path else root / "config" / "config.yaml"
    data = _read_mapping(path, "config file")
    # An allowance in the shared file would hold for every profile; each profile must say what it may skip.
    shared = _skip_allowances_in(data)
    if shared:
        raise ConfigError(f"config field '{shared[0]}' in {path}: skip allowances are per profile; "
                          f"set them in config/profiles/<profile>.yaml")
    prof = profile or (overrides or {}).get("profile") or data.get("profile", "cpu")
    if prof not in PROFILES:
        raise ConfigError(f"config field 'profile': {prof!r} is not one of {list(PROFILES)}")
    prof_file = root / "config" / "profiles" / f"{prof}.yaml"
    if not prof_file.is_file():
        raise ConfigError(f"profile file not found: {prof_file}")
    data = deep_merge(data, yaml.safe_load(prof_file.read_text()) or {})
    for given in overlays:
        overlay = overlay_file(given, root)
        path = Path(overlay) if Path(overlay).is_absolute() else root / overlay
        data = deep_merge(data, read_overlay(path))
        data.setdefault("overlays", []).append(str(overlay))
    if overrides:
        data = deep_merge(data, overrides)
    data["profile"] = prof
    validate(data, root / "config" / "config.schema.yaml")
    return Config(data=data, root=root)
