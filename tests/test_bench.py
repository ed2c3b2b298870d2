"""The matched-pair harness: statistics on known inputs, order alternation, warm-up exclusion, nesting."""
import time

import pytest

from kmesh.bench import Intervals, TimingError, alternate, paired_stats, rotate, run_pairs


def test_paired_stats_known_values():
    s = paired_stats([1.0, 2.0, 3.0], [2.0, 2.0, 1.0])
    assert s["diffs"] == [1.0, 0.0, -2.0]
    assert s["median_diff"] == 0.0
    assert s["ratios"] == [2.0, 1.0, pytest.approx(1 / 3)]
    assert s["median_ratio"] == 1.0
    assert s["b_faster"] == 1
    assert s["median_a"] == 2.0 and s["median_b"] == 2.0


def test_paired_stats_is_median_of_differences_not_difference_of_medians():
    a = [10.0, 1.0, 5.0, 7.0]
    b = [1.0, 9.0, 4.0, 6.0]
    s = paired_stats(a, b)
    # diffs: -9, 8, -1, -1 -> median -1 ; difference of medians would be 5 - 6 = -1 too, so pick a sharper case
    assert s["median_diff"] == -1.0
    s2 = paired_stats([1.0, 100.0, 3.0], [2.0, 1.0, 6.0])
    # diffs 1, -99, 3 -> median 1 ; medians: a=3, b=2 -> difference of medians -1
    assert s2["median_diff"] == 1.0
    assert s2["median_b"] - s2["median_a"] == -1.0
    assert s2["b_faster"] == 1


def test_paired_stats_rejects_unmatched():
    with pytest.raises(TimingError):
        paired_stats([1.0], [1.0, 2.0])
    with pytest.raises(TimingError):
        paired_stats([], [])


def test_run_pairs_alternates_order_and_drops_warmup():
    calls = []

    def fn(arm, child, iv):
        calls.append((arm, child))
        with iv.part("outer"):
            with iv.part("inner"):
                pass

    t = run_pairs(fn, ("A", "B"), children=["c1", "c2"], pairs=4, warmup=2, progress=False)
    assert len(t.pairs) == 4
    assert [p["order"] for p in t.pairs] == [["A", "B"], ["B", "A"], ["A", "B"], ["B", "A"]]
    # 6 pairs in all (2 warm-up) x 2 arms x 2 children
    assert len(calls) == 24
    assert t.parents == {"inner": "outer", "outer": None}
    s = t.summary()
    assert set(s) == {"outer", "inner"} and s["outer"]["pairs"] == 4


def test_alternate_orders_discards_warmup_and_runs_both_arms_every_round():
    """The lower-level loop (whole-group arms, e.g. the storage stage's read-once pairs): each round runs both arms
    on the same round, the first arm alternates with A first in the first kept pair, warm-up rounds are dropped."""
    calls = []

    def run_arm(arm, round_index):
        calls.append((arm, round_index))
        return {"group": [float(round_index)], "load": [1.0, 2.0, 9.0] if arm == "A" else [3.0, 4.0, 0.0]}

    t = alternate(("A", "B"), pairs=3, warmup=2, run_arm=run_arm)
    assert calls == [("A", 0), ("B", 0), ("B", 1), ("A", 1), ("A", 2), ("B", 2), ("B", 3), ("A", 3),
                     ("A", 4), ("B", 4)]
    assert [p["order"] for p in t.pairs] == [["A", "B"], ["B", "A"], ["A", "B"]]
    assert [p["A"]["group"] for p in t.pairs] == [[2.0], [3.0], [4.0]]      # rounds 0 and 1 discarded
    assert all(p["A"]["group"] == p["B"]["group"] for p in t.pairs)        # both arms ran the same round
    s = t.summary()
    assert s["load"]["median_a"] == 2.0 and s["load"]["median_b"] == 3.0 and s["load"]["pairs"] == 3
    d = t.to_dict()
    assert d["design"]["pairs"] == 3 and d["design"]["warmup"] == 2 and d["arms"] == {"A": "A", "B": "B"}
    with pytest.raises(TimingError):
        alternate(("A", "B"), pairs=0, warmup=0, run_arm=run_arm)


def test_rotate_shares_rounds_and_every_pairing_alternates():
    """Three arms in shared rounds (the TTFT's full / repair / end-to-end): each round runs every arm once, listed
    order then reversed; any two arms' pairs alternate which goes first; a pairing takes its arms' times of the same
    round and names the arms it shared them with."""
    calls = []

    def run_arm(arm, round_index):
        calls.append((arm, round_index))
        return {"t": [float(round_index) + {"F": 0.0, "R": 0.5, "E": 0.25}[arm]]}

    rounds = rotate(("F", "R", "E"), pairs=4, warmup=1, run_arm=run_arm)
    # round 0 is the warm-up, reversed so that the first kept round runs the listed order
    assert calls[:6] == [("E", 0), ("R", 0), ("F", 0), ("F", 1), ("R", 1), ("E", 1)]
    assert len(calls) == 15 and len(rounds.records) == 4
    for a, b in (("F", "R"), ("F", "E"), ("R", "E")):
        t = rounds.paired(a, b)
        assert [p["order"][0] for p in t.pairs] == [a, b, a, b]
        assert [p[a]["t"][0] - p[b]["t"][0] for p in t.pairs] == [t.pairs[0][a]["t"][0] - t.pairs[0][b]["t"][0]] * 4
        d = t.to_dict()
        assert d["design"]["order"] == "alternating, A first in pair 0"
        assert d["design"]["rounds_shared_with"] == [x for x in ("F", "R", "E") if x not in (a, b)]
    assert rounds.paired("E", "F").to_dict()["design"]["order"] == "alternating, B first in pair 0"
    assert rounds.paired("F", "E").summary()["t"]["median_diff"] == 0.25
    with pytest.raises(TimingError):
        rounds.paired("F", "X")
    with pytest.raises(TimingError):
        rotate(("F", "F"), pairs=1, warmup=0, run_arm=run_arm)
    with pytest.raises(TimingError):
        rotate(("F", "R"), pairs=0, warmup=0, run_arm=run_arm)


def test_run_pairs_is_alternate_over_children():
    """run_pairs gives alternate one arm run per child and the intervals' nesting, nothing else."""
    def fn(arm, child, iv):
        with iv.part("outer"):
            with iv.part("inner"):
                pass

    t = run_pairs(fn, ("A", "B"), children=["c1", "c2", "c3"], pairs=2, warmup=1, progress=False)
    assert all(len(p[arm][part]) == 3 for p in t.pairs for arm in ("A", "B") for part in ("outer", "inner"))
    assert t.to_dict()["design"]["nesting"] == {"outer": None, "inner": "outer"}


def test_run_pairs_per_pair_value_is_median_over_children(monkeypatch):
    """On a clock that only the work advances (the Intervals' own stamps, not the wall clock: under make test's
    load a 0 s sleep measured over 5 ms and failed a wall-clock bound here), the per-pair value is the median
    child's time, exactly."""
    import kmesh.bench as bench

    delays = {"A": {"x": 0.0, "y": 0.0, "z": 0.03}, "B": {"x": 0.01, "y": 0.01, "z": 0.01}}
    now = [0]
    monkeypatch.setattr(bench.Intervals, "_stamp", lambda self: now[0])

    def fn(arm, child, iv):
        with iv.part("work"):
            now[0] += round(delays[arm][child] * 1e9)

    t = run_pairs(fn, ("A", "B"), children=["x", "y", "z"], pairs=3, warmup=0, progress=False)
    s = t.summary()["work"]
    # A's median child is 0 s (the 30 ms outlier is not the median); B's is 10 ms, in every pair
    assert s["median_a"] == 0.0 and s["median_b"] == 0.01
    assert t.per_pair("A", "work") == [0.0] * 3 and t.per_pair("B", "work") == [0.01] * 3
    assert s["b_faster"] == 0


def test_intervals_sum_repeats_and_reject_bad_nesting():
    iv = Intervals("cpu")
    for _ in range(3):
        with iv.part("read"):
            time.sleep(0.002)
    assert iv.seconds()["read"] >= 0.006
    iv2 = Intervals("cpu")
    with iv2.part("a"):
        with iv2.part("b"):
            pass
    with pytest.raises(TimingError):
        with iv2.part("b"):  # b was nested under a before; now at top level
            pass
    with pytest.raises(TimingError):
        Intervals("tpu")


@pytest.mark.gpu
def test_intervals_cuda_events():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    x = torch.randn(1 << 24, device="cuda")
    iv = Intervals("cuda")
    with iv.part("copy"):
        y = x.clone()
    assert iv.seconds()["copy"] > 0
    del y


def test_parts_timed_in_one_arm_only_are_refused():
    def fn(arm, child, iv):
        with iv.part("read" if arm == "A" else "load"):
            pass

    t = run_pairs(fn, ("A", "B"), children=[0], pairs=3, warmup=0, progress=False)
    with pytest.raises(TimingError, match="not timed in arm"):
        t.summary()


@pytest.mark.parametrize("n", [2, 3, 4, 5])
def test_williams_orders_balance_positions_and_who_goes_first(n):
    from itertools import combinations

    from kmesh.bench import williams_orders

    rows = williams_orders(n)
    assert len(rows) == (n if n % 2 == 0 else 2 * n) and all(sorted(r) == list(range(n)) for r in rows)
    for pos in range(n):                         # every arm in every position equally often
        assert sorted(r[pos] for r in rows) == sorted(list(range(n)) * (len(rows) // n))
    for a, b in combinations(range(n), 2):       # in every pairing each arm first in half the rows
        assert 2 * sum(r.index(a) < r.index(b) for r in rows) == len(rows)


def test_balanced_rounds_put_every_arm_first_and_record_positions():
    """Four arms (the peers'): over one cycle (4 rounds) every arm runs first once; a pairing's design says it is
    balanced and how often A went first; by_position shows a carry-over (here: the arm after "L" is slower)."""
    def run_arm(arm, round_index):
        return {"t": [1.0]}

    arms = ("V", "P", "L", "K")
    seen = []

    def timed(arm, round_index):
        seen.append((round_index, arm))
        return {"t": [1.0]}

    rounds = rotate(arms, pairs=4, warmup=1, run_arm=timed, design="balanced")
    orders = [r["order"] for r in rounds.records]
    assert sorted(o[0] for o in orders) == sorted(arms) and all(sorted(o) == sorted(arms) for o in orders)
    assert orders[0] == ["V", "P", "K", "L"]
    d = rounds.paired("V", "L").to_dict()["design"]
    assert d["order"] == "balanced (Williams design), A first in 2 of 4 pairs"
    pos = rounds.by_position("t")
    assert {arm: sum(v["rounds"] for v in p.values()) for arm, p in pos.items()} == dict.fromkeys(arms, 4)
    assert all(set(p) == {"0", "1", "2", "3"} for p in pos.values())
    two = rotate(("A", "B"), pairs=4, warmup=0, run_arm=run_arm, design="balanced")
    assert [r["order"] for r in two.records] == [r["order"] for r in rotate(("A", "B"), 4, 0, run_arm).records]
    with pytest.raises(TimingError, match="unknown round design"):
        rotate(arms, pairs=1, warmup=0, run_arm=run_arm, design="random")


def test_by_position_reads_a_carry_over():
    from kmesh.bench import Rounds

    r = Rounds(("A", "B"), warmup=0, balanced=True)
    r.records = [{"order": ["A", "B"], "A": {"t": [1.0]}, "B": {"t": [3.0]}},   # B after A: slow
                 {"order": ["B", "A"], "A": {"t": [1.0]}, "B": {"t": [2.0]}}]
    assert r.by_position("t")["B"] == {"0": {"rounds": 1, "median": 2.0}, "1": {"rounds": 1, "median": 3.0}}
