"""Issue 21 item 6: no stage records a check that cannot fail. A literal `True` looks like a computed one once it is
in a result file, so the guard is kmesh.devtools.constant_checks, a static scan of the stage code: it must find
nothing in today's stages, find each shape in small synthetic sources (and leave the honest look-alikes alone),
and find the three checks the review named in the code as it was (kept verbatim below, from a95ebef)."""
from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from kmesh.devtools.constant_checks import main, scan_paths, scan_source, stage_sources

ROOT = Path(__file__).resolve().parent.parent


def rules(source: str) -> list[str]:
    return [f.rule for f in scan_source(textwrap.dedent(source))]


def test_no_stage_has_a_check_that_cannot_fail():
    found = scan_paths(stage_sources(ROOT))
    assert found == [], "\n".join(map(str, found))
    assert len(stage_sources(ROOT)) > 30        # the scan reads every stage module


@pytest.mark.parametrize("source, rule", [
    ('case.check("x", True)', "constant"),
    ('case.check("x", False, "never")', "constant"),
    ('case.check("x", ok=True)', "constant"),
    ('case.check("x", measured == 3 or True)', "constant"),
    ('case.check("x", measured if strict else True)', "constant"),
    ('case.check("x", not measured and 1)', "constant"),
    ('case.check("x", all(v == 0 for v in rot.values()) or ctx.restore_backend != "torch")', "setting-or"),
    ('case.check("x", measured or sec["lenient"])', "setting-or"),
    ('case.check("x", measured or not setup.sec.get("strict"))', "setting-or"),
    ('case.check("x", measured or cfg.profile == "cuda")', "setting-or"),
    ('case.check("x", sec["expect_ok"])', "setting-or"),
    ("def f(case):\n    ok = True\n    case.check('x', ok)", "constant-name"),
    ("def f(case):\n    ok: bool = True\n    case.check('x', ok)", "constant-name"),
    ("def f(case, ref):\n    out = ref\n    case.check('x', identical(compare_states(ref, out)))", "self-comparison"),
    ("def f(ref):\n    outcome = ref\n    return arm_quality(ref, outcome)", "self-comparison"),
    ("case.check('x', torch.equal(a, a))", "self-comparison"),
    ("case.check('x', a.sum() == a.sum())", "self-comparison"),
])
def test_each_shape_is_found(source, rule):
    assert rule in rules(source), scan_source(textwrap.dedent(source))


@pytest.mark.parametrize("source", [
    'case.check("x", measured == 3)',
    'case.check("state", reg["state"] == "closing", value=reg)',           # a measured state vs a literal
    'case.check("x", v is None or same(a, v))',                              # data-dependent, not a setting
    'case.check("x", "taken over" in (lost["reason"] or ""))',               # `or ""` inside, not an operand
    "def f(case):\n    caught = False\n    try:\n        g()\n    except E:\n        caught = True\n"
    "    case.check('x', caught)",                                            # a flag the run sets
    "def f(case, parts):\n    ok = True\n    for p in parts:\n        ok &= p.fine\n    case.check('x', ok)",
    "def f(case):\n    err = None\n    try:\n        g()\n    except E as e:\n        err = e\n"
    "    case.check('x', err is not None, value=str(err))",
    "restore(raw, layout, saved, new, new, rope)",                            # slots = positions: no comparison
    "RopeConfig(head_dim, head_dim, 1e4)",
    "proto.check(name, body[name])",                                          # a .check that is no Case.check
])
def test_honest_checks_are_left_alone(source):
    assert rules(source) == []


# The three checks the review named, verbatim from the stages at a95ebef (before issue 21).
OLD_GROUP_BENCH = '''
def batched_agreement(res, setup, serial, unbatched):
    with res.case("batched-agreement", {}) as case:
        rot = {n: int((per_member[n].raw != layerwise[n].raw).sum()) for n in per_member}
        case.record("rotation_bytes_differing", rot)
        rot_equal = case.check("rotation_bit_identical" if ctx.restore_backend == "torch" else "rotation_recorded",
                               all(v == 0 for v in rot.values()) or ctx.restore_backend != "torch", value=rot)
'''
OLD_RESTORE_BENCH = '''
def run(cfg):
    with res.case("device", {"device": device}) as case:
        if device == "cuda" and not torch.cuda.is_available():
            case.check("cuda_available", False, "restore_bench.device is cuda but torch sees no GPU")
        else:
            case.check("device_usable", True, torch.cuda.get_device_name() if device == "cuda" else "cpu")
'''
OLD_EQUIVALENCE_QUALITY = '''
def _quality_case(res, setup, refs):
    with res.case("quality", {}) as case:
        for child in setup.workload.children:
            ref = refs[RefKey(FULL, child.name)]
            for arm in arms:
                if arm == "full":
                    outcome = ref
                elif arm == "kmesh":
                    outcome = refs[RefKey(KMESH, child.name)]
                else:
                    outcome = run_child(stock_ctx if arm == "stock" else setup.ctx, child, inproc, staging, private,
                                        arm=arm)
                per_arm[arm].append({"child": child.name, **arm_quality(ref, outcome, child.answer, setup.decode,
                                                                         answer_matches)})
        out = {arm: summarize(rows) for arm, rows in per_arm.items()}
        case.check("full_agrees_with_itself", out["full"]["top1_agreement"] == 1.0 and out["full"]["kl_mean"] == 0.0)
'''


def test_the_three_reviewed_checks_are_found_in_the_old_code():
    group = scan_source(OLD_GROUP_BENCH, "group/bench.py")
    assert [(f.rule, "rotation_recorded" in f.code) for f in group] == [("setting-or", True)]
    device = scan_source(OLD_RESTORE_BENCH, "restore_bench/stage.py")
    assert [f.rule for f in device] == ["constant", "constant"] and "device_usable" in device[1].code
    quality = scan_source(OLD_EQUIVALENCE_QUALITY, "equivalence/stage.py")
    assert [f.rule for f in quality] == ["self-comparison"] and "arm_quality(ref, outcome" in quality[0].code


def test_cli_exit_status(tmp_path, capsys):
    bad = tmp_path / "bad.py"
    bad.write_text('case.check("x", True)\n')
    assert main([str(bad)]) == 1 and "constant" in capsys.readouterr().out
    good = tmp_path / "good.py"
    good.write_text('case.check("x", measured == 3)\n')
    assert main([str(good)]) == 0
