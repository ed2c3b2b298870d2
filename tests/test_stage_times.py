"""The stage-time records: read from result files, preferred over the committed table for the same variant only,
rendered as docs/testing.md's table, and that table equal to the committed records."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kmesh import stage_times
from kmesh.stages import STAGES

ROOT = Path(__file__).resolve().parents[1]


def _result(folder: Path, stage: str, start: str, end: str, cpu: float | None, overlays: list[str], cases: int = 2,
            rev: str = "abcdef0123") -> Path:
    prov = {"start": start, "end": end, "torch_threads": 2, "kmesh": {"rev": rev}, "config": {"overlays": overlays}}
    if cpu is not None:
        prov["resources"] = {"cpu_s": cpu}
    path = folder / "cpu" / stage / "result.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"stage": stage, "profile": "cpu", "provenance": prov,
                                "cases": [{"id": f"c{i}"} for i in range(cases)]}))
    return path


def test_a_result_gives_wall_cpu_cases_and_its_variant(tmp_path):
    path = _result(tmp_path, "drain", "2026-12-07T10:00:00+00:00", "2026-12-07T10:01:05.25+00:00", 80.04,
                   ["config/overlays/test.yaml"], cases=3)
    t = stage_times.read_stage_time(path)
    assert (t.stage, t.wall_s, t.cpu_s, t.cases, t.threads, t.rev) == ("drain", 65.2, 80.0, 3, 2, "abcdef0")
    assert stage_times.result_variant(path) == "cpu+test"
    path.write_text("{not json")
    assert stage_times.read_stage_time(path) is None and stage_times.result_variant(path) is None


def test_only_the_same_variant_is_an_expectation_and_the_last_run_wins(tmp_path):
    table = tmp_path / "table.json"
    _result(tmp_path, "drain", "2026-12-07T10:00:00+00:00", "2026-12-07T10:00:30+00:00", 30.0, [])
    _result(tmp_path, "model", "2026-12-07T10:00:00+00:00", "2026-12-07T10:00:09+00:00", 9.0, ["long"])
    committed = {"drain": stage_times.StageTime("drain", 99.0, 1.0, 7, 1, "1234567", "2026-12-01T00:00:00+00:00"),
                 "model": stage_times.StageTime("model", 44.0, 1.0, 8, 1, "1234567", "2026-12-01T00:00:00+00:00")}
    stage_times.write_committed(committed, "cpu", "m", "n", path=table)
    got = stage_times.expectations(tmp_path, "cpu", (), table=table)
    assert got["drain"] == stage_times.Expectation(30.0, 2, "last run here")
    assert got["model"] == stage_times.Expectation(44.0, 8, "committed table at 1234567")   # the long run is not it
    assert stage_times.expectations(tmp_path, "cpu", ["long"], table=table) == {
        "model": stage_times.Expectation(9.0, 2, "last run here")}


def test_write_keeps_other_variants_and_reads_back(tmp_path):
    table = tmp_path / "table.json"
    one = {"a": stage_times.StageTime("a", 1.0, 2.0, 3, 1, "r", "2026-12-07T10:00:00+00:00")}
    stage_times.write_committed(one, "cpu", "m", "first", path=table)
    stage_times.write_committed(one, "cpu+long", "m", "second", path=table)
    assert stage_times.from_committed("cpu", path=table) == one == stage_times.from_committed("cpu+long", path=table)
    assert stage_times.committed(table)["cpu"]["note"] == "first"
    assert stage_times.from_committed("cpu+test", path=table) == {}


def test_the_table_sums_and_spans_stages_beside_each_other():
    times = {"a": stage_times.StageTime("a", 10.0, 20.0, 1, 2, "r", "2026-12-07T10:00:00+00:00"),
             "b": stage_times.StageTime("b", 30.0, None, 4, None, "r", "2026-12-07T10:00:05+00:00")}
    assert stage_times.span(times) == 35.0
    lines = stage_times.markdown(times, ["b", "a", "missing"]).splitlines()
    assert lines[2] == "| b | 5 s | 30 s |  |  | 4 |  |"
    assert lines[3] == "| a | 0 s | 10 s | 20 s | 2.00 | 1 | 2 |"
    assert lines[4] == "| sum | | 40 s | 20 s | | | |" and lines[5] == "| first start to last end | | 35 s | | | | |"


@pytest.mark.parametrize("key", sorted(stage_times.committed()))
def test_docs_testing_carries_the_committed_tables(key):
    """docs/testing.md's stage-time tables are the committed records (`python -m kmesh times --committed`)."""
    text = (ROOT / "docs" / "testing.md").read_text()
    block = re.search(rf"<!-- stage-times {re.escape(key)} -->\n(.*?)\n<!-- /stage-times -->", text, re.S)
    assert block, f"docs/testing.md has no table of {key} (<!-- stage-times {key} --> ... <!-- /stage-times -->)"
    assert block[1] == stage_times.markdown(stage_times.from_committed(key), STAGES)


def test_the_times_command_prints_a_folders_records_and_refuses_an_empty_one(tmp_path, capsys):
    from kmesh import cli

    _result(tmp_path, "drain", "2026-12-07T10:00:00+00:00", "2026-12-07T10:00:30+00:00", 30.0, [])
    assert cli.main(["times", "--results-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| drain | 0 s | 30 s | 30 s | 1.00 | 2 | 2 |" in out and "cpu, revision(s) abcdef0" in out
    assert cli.main(["times", "--results-dir", str(tmp_path), "--overlay", "long"]) == 1
    assert "no stage results of cpu+long" in capsys.readouterr().err
    assert cli.main(["times", "--committed", "--overlay", "no-such-overlay"]) == 1
