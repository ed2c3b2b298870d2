"""Stage `synthetic` (§21): its case grid, a full CPU run, and deliberate bugs in test doubles that it must catch."""
import itertools

import pytest
import torch

from kmesh.config import load_config
from kmesh.kv.restore import plan_restore, restore
from kmesh.result import Result
from kmesh.stages import synthetic as syn


def test_case_grid_covers_every_arrangement_shift_dtype_and_block_size():
    specs = syn.case_specs()
    assert len(specs) >= 32
    assert len({s.id for s in specs}) == len(specs)
    pairs = {(s.arrangement, s.shift) for s in specs}
    assert pairs == set(itertools.product(syn.ARRANGEMENTS, syn.SHIFTS))
    for arr in syn.ARRANGEMENTS:
        mine = [s for s in specs if s.arrangement == arr]
        assert {s.dtype for s in mine} == set(syn.DTYPES), arr
        blocks = syn.CPU_BLOCK_SIZES if arr.startswith("cpu") else syn.BLOCK_SIZES
        assert {s.block_size for s in mine} == set(blocks), arr
    assert {s.rope for s in specs} == set(syn.ROPES)
    assert {s.first_layer for s in specs} == {0, 1}


def test_stage_runs_on_cpu_and_all_cases_pass(tmp_path):
    cfg = load_config(profile="cpu", overrides={"results_dir": str(tmp_path)})
    res = syn.run(cfg)
    s = res.summary()
    assert s["cases"] >= 32 and s["failed"] == 0 and s["skipped"] == 0, [
        (c.id, c.error, {k: v for k, v in c.checks.items() if v["ok"] is False}) for c in res.cases if not c.passed]
    accuracy = [c for c in res.cases if c.id.startswith("rope-accuracy-")]
    assert {c.id for c in accuracy} == {"rope-accuracy-smollm2", "rope-accuracy-qwen2.5"}
    assert all(c.checks["fp32_shift_max_rel_le_1e-5"]["ok"] for c in accuracy)
    freq = [c for c in res.cases if c.id == "rope-reference-frequencies"]
    assert len(freq) == 1 and freq[0].passed and freq[0].checks["max_ulp"]["value"] == 0
    for c in res.cases:
        if c.id.startswith("rope-"):
            continue
        assert c.checks["canary_untouched"]["ok"] and c.checks["keys_vs_float64"]["ok"]
        if not c.id.startswith("mla"):
            assert c.checks["values_bit_identical"]["ok"]
    written = res.write(tmp_path / "synthetic.json")
    assert written.is_file()


def _one_case(arrangement="paged:BLNHC", dtype="bfloat16", shift="forward", rope="neox", block=16, first_layer=1):
    spec = syn.CaseSpec(arrangement, dtype, block, shift, rope, first_layer)
    return syn.build_case(spec, seed=5, device="cpu")


def _run_double(d, fn):
    res = Result("synthetic", "cpu", {})
    with res.case(d.spec.id) as c:
        syn.run_case(c, d, restore_fn=fn)
    return res.cases[0]


def test_honest_restore_passes_the_same_checks():
    case = _run_double(_one_case(), restore)
    assert case.passed, case.checks


@pytest.mark.parametrize("arrangement", ["paged:BLNHC", "cpu:LBHNC", "mla:LBNHC"])
def test_one_slot_off_bug_is_caught_by_the_canary(arrangement):
    d = _one_case(arrangement, block=32 if arrangement.startswith("cpu") else 16)
    n = d.layout.num_slots

    def off_by_one(raw, layout, seg, slots, new_pos, rope, first_layer=0):
        # a buggy double: every real token lands one slot further on (a bijection, so no duplicate slots)
        bad = torch.where(slots >= 0, (slots + 1) % n, slots)
        return restore(raw, layout, seg, bad, new_pos, rope, first_layer=first_layer)

    case = _run_double(d, off_by_one)
    assert case.passed is False
    assert case.checks["canary_untouched"]["ok"] is False
    assert case.checks["canary_untouched"]["value"]["changed"] > 0


def test_wrong_layer_is_caught_by_the_canary():
    d = _one_case(first_layer=1)

    def wrong_layer(raw, layout, seg, slots, new_pos, rope, first_layer=0):
        return restore(raw, layout, seg, slots, new_pos, rope, first_layer=first_layer - 1)

    case = _run_double(d, wrong_layer)
    assert case.checks["canary_untouched"]["ok"] is False


def test_unshifted_keys_fail_the_float64_check():
    d = _one_case(shift="backward")

    def no_shift(raw, layout, seg, slots, new_pos, rope, first_layer=0):
        return restore(raw, layout, seg, slots, seg.positions, rope, first_layer=first_layer)

    case = _run_double(d, no_shift)
    assert case.checks["keys_vs_float64"]["ok"] is False
    assert case.checks["canary_untouched"]["ok"] is True   # it wrote the right cells, only the wrong keys


def test_shift_in_the_wrong_direction_fails_the_float64_check():
    d = _one_case(shift="forward", rope="gptj")

    def backwards(raw, layout, seg, slots, new_pos, rope, first_layer=0):
        mirrored = 2 * seg.positions - new_pos
        mirrored = mirrored.clamp(min=0)
        return restore(raw, layout, seg, slots, mirrored, rope, first_layer=first_layer)

    case = _run_double(d, backwards)
    assert case.checks["keys_vs_float64"]["ok"] is False


def test_corrupted_value_byte_fails_values_check():
    d = _one_case()

    def flip_one_value_byte(raw, layout, seg, slots, new_pos, rope, first_layer=0):
        plan = plan_restore(raw, layout, seg, slots, new_pos, rope, first_layer)
        plan.run("torch")
        b, n = layout.split_slots(slots[:1])
        v = layout.v_tensor(plan.flat)
        v[first_layer, b, n, 0, 3] = -v[first_layer, b, n, 0, 3] - 1   # a different value in one destination cell

    case = _run_double(d, flip_one_value_byte)
    assert case.checks["values_bit_identical"]["ok"] is False
    assert case.checks["canary_untouched"]["ok"] is True


def test_rotating_the_unrotated_channels_fails_check_d():
    d = _one_case("mla:BLHNC", dtype="float16")

    def touch_latent(raw, layout, seg, slots, new_pos, rope, first_layer=0):
        plan = plan_restore(raw, layout, seg, slots, new_pos, rope, first_layer)
        plan.run("torch")
        b, n = layout.split_slots(slots[slots >= 0])
        k = layout.k_tensor(plan.flat)
        k[first_layer, b, n, 0, 0] = k[first_layer, b, n, 0, 0] + 1   # channel 0 is latent, never rotated

    case = _run_double(d, touch_latent)
    assert case.checks["unrotated_channels_identical"]["ok"] is False


@pytest.mark.parametrize("arrangement", ["paged:LHBNC", "cpu:LBHNC", "mla:BLHNC"])
def test_slot_addressing_bug_in_the_layout_itself_is_caught(monkeypatch, arrangement):
    # The bug sits in KVLayout.split_slots, which restore uses: the stage's read-back and canary must not.
    d = _one_case(arrangement, block=32 if arrangement.startswith("cpu") else 16)

    def split_slots(self, slots):  # offset one further on, wrapping inside its block (stays in bounds)
        return torch.div(slots, self.block_size, rounding_mode="floor"), torch.remainder(slots + 1, self.block_size)

    monkeypatch.setattr(syn.KVLayout, "split_slots", split_slots)
    case = _run_double(d, restore)
    assert case.error is None and case.passed is False
    assert case.checks["canary_untouched"]["ok"] is False
    if not arrangement.startswith("mla"):
        assert case.checks["values_bit_identical"]["ok"] is False


def _reversed_apply_rotation_code():
    # kmesh.kv.rope.apply_rotation with sin -> -sin, as a code object (so restore's imported name runs it too)
    import inspect
    import textwrap

    import kmesh.kv.rope

    src = textwrap.dedent(inspect.getsource(kmesh.kv.rope.apply_rotation))
    line = "s = sin.to(math_dtype).reshape(view)"
    assert src.count(line) == 1
    ns = {}
    exec(compile(src.replace(line, "s = -sin.to(math_dtype).reshape(view)"), kmesh.kv.rope.__file__, "exec"),
         kmesh.kv.rope.__dict__, ns)
    return kmesh.kv.rope.apply_rotation, ns["apply_rotation"].__code__


@pytest.mark.parametrize("rope", ["neox", "gptj", "yarn"])
def test_reversed_rotation_in_rope_itself_is_caught(monkeypatch, rope):
    fn, code = _reversed_apply_rotation_code()
    monkeypatch.setattr(fn, "__code__", code)
    d = _one_case("paged:LBNHC", dtype="float32", shift="backward", rope=rope)
    case = _run_double(d, restore)
    assert case.error is None
    assert case.checks["keys_vs_float64"]["ok"] is False
    assert case.checks["canary_untouched"]["ok"] is True
