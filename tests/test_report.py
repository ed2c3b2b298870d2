"""Report rendering: tables carry the paired statistics of the result file, plots are written."""
import pandas as pd

from kmesh.bench import PairedTiming
from kmesh.config import SkipAllowance, load_config
from kmesh.report.tables import stage_status
from kmesh.result import Result


def _timing() -> PairedTiming:
    t = PairedTiming("staging", "direct", warmup=1)
    # Three pairs, one child each: A = 10, 20, 30 ms; B = 5, 25, 12 ms.
    for a, b, order in ((0.010, 0.005, ["staging", "direct"]), (0.020, 0.025, ["direct", "staging"]),
                        (0.030, 0.012, ["staging", "direct"])):
        t.pairs.append({"order": order, "staging": {"read": [a], "outer": [2 * a]},
                        "direct": {"read": [b], "outer": [2 * b]}})
    t.parents = {"read": "outer", "outer": None}
    return t


def test_render_paired_table_and_plots(tmp_path):
    cfg = load_config(overrides={"results_dir": str(tmp_path)})
    res = Result.begin("drain", cfg)
    with res.case("c1") as c:
        c.check("ok", True)
    with res.case("c2") as c:
        c.check("ok", False)
    res.timings["storage"] = _timing().to_dict()
    res.write(tmp_path / "cpu" / "drain" / "result.json")

    from kmesh.stages.report import run

    out = run(cfg)
    assert out.ok, [c.to_dict() for c in out.cases]
    tables = tmp_path / "cpu" / "tables"
    df = pd.read_csv(tables / "drain_storage.csv")
    read = df[df["part"].str.startswith("read")].iloc[0]
    # diffs: -5, +5, -18 ms -> median -5 ms; ratios 0.5, 1.25, 0.4 -> median 0.5; direct faster in 2 of 3
    assert abs(read["median Δ (direct − staging) [ms]"] - (-5.0)) < 1e-9
    assert abs(read["median ratio direct/staging"] - 0.5) < 1e-12
    assert read["direct faster"] == "2/3"
    assert "⊂ outer" in read["part"]
    md = (tables / "drain_storage.md").read_text()
    assert "3 matched pairs after 1 warm-up" in md
    summary = pd.read_csv(tables / "summary.csv")
    assert summary.loc[summary.stage == "drain", "status"].item() == "FAILED"
    for ext in ("png", "svg"):
        assert (tmp_path / "cpu" / "plots" / f"drain_storage.{ext}").stat().st_size > 1000
        assert (tmp_path / "cpu" / "plots" / f"summary.{ext}").stat().st_size > 1000
    assert (tables / "drain_cases.tex").read_text().startswith("\\begin{table}")


# The report's stage verdict follows the result file's own rule (kmesh.result): skips must be allowed and a
# stage must prove something.
def _summary(outcomes: list[str], allow: tuple[str, ...] = ()) -> dict:
    res = Result("demo", "cpu", {}, allow_skips=tuple(SkipAllowance(p, "test") for p in allow))
    for i, o in enumerate(outcomes):
        with res.case(f"case-{i}") as c:
            if o == "skip":
                c.skip("not here")
            c.check("x", o == "pass")
    return res.summary()


def test_stage_status_matches_the_result_rule() -> None:
    assert stage_status(_summary(["pass", "pass"])) == "passed"
    assert stage_status(_summary(["pass", "fail"])) == "FAILED"
    assert stage_status(_summary(["pass", "skip"])).startswith("FAILED (1 skip(s) not allowed")
    assert stage_status(_summary(["pass", "skip"], allow=("case-1",))) == "passed (1 allowed skip(s))"
    assert stage_status(_summary(["skip"], allow=("case-*",))) == "FAILED (no case passed)"
    assert stage_status(_summary([])) == "no cases"


def test_quality_table_and_plot_show_every_arm_and_fraction(tmp_path):
    """The quality table: one row per arm (stock and stock-matched both), KL first token and teacher-forced, and
    the recomputed fractions of all positions and of restored positions, each under its own name."""
    from kmesh.model.quality import summarize
    from kmesh.report import plots, tables

    def row(kl, kl_tf, n, restored_frac):
        return {"top1_agree": True, "kl": kl, "kl_teacher_forced": kl_tf, "top1_teacher_forced": 0.75,
                "first_divergence": 5, "exact_match": True, "recomputed_positions": n,
                "recomputed_fraction_of_positions": n / 512, "recomputed_fraction_of_restored": restored_frac,
                "recomputed_fraction_of_layer_positions": 0.5}

    quality = {"full": summarize([row(0.0, 0.0, 512, None)]), "naive": summarize([row(0.1, 0.3, 96, 0.0)]),
               "stock": summarize([row(5.0, 6.0, 76, 0.1)]), "stock-matched": summarize([row(0.05, 0.2, 157, 0.3)]),
               "repair": summarize([row(0.01, 0.02, 157, 0.15)])}
    df = tables.quality_frame(quality)
    assert df["arm"].tolist() == ["full", "naive", "stock", "stock-matched", "repair"]
    for col in ("KL(full ‖ arm) first token, mean", "KL(full ‖ arm) teacher-forced, mean",
                "recomputed / all positions", "recomputed / restored positions"):
        assert col in df.columns, df.columns
    by_arm = df.set_index("arm")
    assert by_arm.loc["stock-matched", "recomputed positions per child"] == by_arm.loc["repair",
                                                                                       "recomputed positions per child"]
    assert by_arm.loc["repair", "KL(full ‖ arm) teacher-forced, mean"] == 0.02
    assert by_arm.loc["repair", "recomputed / restored positions"] == 0.15
    assert pd.isna(by_arm.loc["full", "recomputed / restored positions"])
    assert "stock-matched" in tables.quality_caption("equivalence")
    for p in plots.quality_plot(quality, tmp_path / "q", ["png"], "quality"):
        assert p.stat().st_size > 1000


def test_reliability_table_has_one_row_per_test_run():
    from kmesh.report.tables import reliability_frame

    summary = {"soak": {"load": "10 ops", "faults": "1 loads cancelled mid-copy", "bad_inputs": 0, "divergences": 0,
                        "service_survived": True, "data_lost": 0, "internal_errors": 0},
               "crash": {"load": "3 saves", "faults": "2 service SIGKILLs", "bad_inputs": "1 temp files",
                         "divergences": 0, "service_survived": True, "data_lost": 0}}
    df = reliability_frame(summary)
    assert list(df["test"]) == ["soak under memory pressure", "service crash consistency"]
    assert list(df.columns) == ["test", "load held", "faults injected", "bad inputs tried", "divergences",
                                "internal errors", "service survived", "data lost"]
    assert df.iloc[1]["faults injected"] == "2 service SIGKILLs"
    assert df.iloc[0]["internal errors"] == 0


def test_remote_tables_read_the_stage_summary(tmp_path):
    from kmesh.report import plots, tables

    summary = {"remote_arms": {"remote": {"median_ms": 880.0, "pairs": 5, "ratio_vs_remote": 1.0,
                                          "remote_faster": None},
                               "full": {"median_ms": 1459.0, "pairs": 5, "ratio_vs_remote": 1.64, "remote_faster": 5}},
               "remote_faults": {"fail-tampered": {"error": "RemoteRejectedError: digest mismatch", "fallback_s": 2.7,
                                                   "b_counters": {"fetches": 1, "fetch_rejected": 1},
                                                   "recomputed_equal_full": True, "held_as_at_start": True,
                                                   "recovered": True}}}
    df = tables.remote_frame(summary)
    assert list(df["first token median [ms]"]) == ["880.0", "1459.0"]
    assert list(df["pairs remote faster"]) == ["—", "5/5"]
    faults = tables.remote_faults_frame(summary)
    assert faults.iloc[0]["B's remote counters"] == "fetches 1, fetch_rejected 1"
    raw = [{"order": ["remote", "full"], "remote": {"first-token": [0.8, 0.9]}, "full": {"first-token": [1.4, 1.5]}}]
    timings = {"remote_vs_full": {"raw": raw}, "remote_vs_disk": {"raw": [{"remote": {"first-token": [0.8]},
                                                                          "disk": {"first-token": [0.7]}}]}}
    assert plots.remote_plot(timings, tmp_path / "r", ["png"], "remote")[0].stat().st_size > 1000


def _peers_rounds() -> dict:
    """ttft timings as the peers stage writes them: four arms' shared rounds, drawn as pairings."""
    from kmesh.bench import Rounds

    arms = ("vllm", "vllm-prefix", "lmcache", "kmesh")
    ms = {"vllm": 0.100, "vllm-prefix": 0.030, "lmcache": 0.050, "kmesh": 0.020}
    rounds = Rounds(arms, warmup=0)
    for i in range(3):
        order = list(arms) if i % 2 == 0 else list(reversed(arms))
        rounds.records.append({"order": order, **{a: {"ttft": [ms[a] * (1 + 0.01 * i)]} for a in arms}})
    pairings = [("vllm", "vllm-prefix"), ("vllm", "lmcache"), ("vllm", "kmesh"), ("vllm-prefix", "lmcache"),
                ("vllm-prefix", "kmesh"), ("lmcache", "kmesh")]
    return {f"ttft_exact_{a}_vs_{b}": rounds.paired(a, b).to_dict() for a, b in pairings}


def test_peers_table_and_plot_carry_vllm_prefix(tmp_path):
    from kmesh.report import plots, tables

    ttft = {"vllm": {"median_ms": 100.0},
            "vllm-prefix": {"median_ms": 30.0, "median_ratio_vs_vllm": 0.3, "pairs_faster_than_vllm": 3, "pairs": 3},
            "lmcache": {"median_ms": 50.0, "median_ratio_vs_vllm": 0.5, "pairs_faster_than_vllm": 3, "pairs": 3,
                        "median_ratio_vs_vllm_prefix": 1.667},
            "kmesh": {"median_ms": 20.0, "median_ratio_vs_vllm": 0.2, "pairs_faster_than_vllm": 3, "pairs": 3,
                      "median_ratio_vs_vllm_prefix": 0.667},
            "reused_per_request": {"vllm-prefix": [304], "lmcache": [256], "kmesh": [319]}}
    exact = {"arms": {a: {"tokens_equal": {"cold": True, "repeat": True}, "reused": {"repeat": n}}
                      for a, n in (("vllm-prefix", 304), ("lmcache", 256), ("kmesh", 319))}}
    frame = tables.peers_frame({"exact": exact, "ttft_exact": ttft})
    rows = {r["arm"]: r for r in frame.to_dict("records") if r["workload"].startswith("exact")}
    assert list(rows) == ["vllm", "vllm-prefix", "lmcache", "kmesh"]
    assert rows["vllm-prefix"]["tokens reused (own count)"] == 304 and rows["vllm-prefix"]["ratio vs vllm"] == "0.300"
    assert rows["kmesh"]["ratio vs vllm-prefix"] == "0.667" and rows["vllm-prefix"]["ratio vs vllm-prefix"] == "—"
    # a result from before vllm-prefix existed: three arms, no row invented for the fourth
    old = {a: v for a, v in ttft.items() if a != "vllm-prefix"}
    assert "vllm-prefix" not in set(tables.peers_frame({"exact": {"arms": {}}, "ttft_exact": old})["arm"])
    written = plots.peers_plot(_peers_rounds(), tmp_path / "peers", ["png"], "peers")
    assert written and all(p.stat().st_size > 0 for p in written)
