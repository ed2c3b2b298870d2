"""Config loading: profile overlay, validation errors that name the field."""
import shutil
from pathlib import Path

import pytest
import yaml

from kmesh.config import load_config
from kmesh.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture()
def tree(tmp_path):
    shutil.copytree(ROOT / "config", tmp_path / "config")
    return tmp_path


def _edit(tree, fn):
    p = tree / "config" / "config.yaml"
    data = yaml.safe_load(p.read_text())
    fn(data)
    p.write_text(yaml.safe_dump(data))


def test_default_and_cuda_profiles_validate():
    cpu = load_config(root=ROOT)
    assert cpu.profile == "cpu" and cpu.section("synthetic")["device"] == "cpu"
    cuda = load_config(profile="cuda", root=ROOT)
    assert cuda.profile == "cuda" and cuda.section("synthetic")["device"] == "cuda"
    assert cpu.digest() != cuda.digest()


def test_bad_type_names_the_field(tree):
    _edit(tree, lambda d: d["timing"].__setitem__("warmup", "one"))
    with pytest.raises(ConfigError, match=r"'timing\.warmup'.*not of type 'integer'"):
        load_config(root=tree)


def test_unknown_key_names_the_key(tree):
    _edit(tree, lambda d: d["kernels"].__setitem__("gencodes", "x"))
    with pytest.raises(ConfigError, match=r"'kernels\.gencodes'"):
        load_config(root=tree)


def test_out_of_range_and_bad_pattern(tree):
    _edit(tree, lambda d: d["timing"].__setitem__("warmup", -1))
    with pytest.raises(ConfigError, match=r"'timing\.warmup'.*minimum"):
        load_config(root=tree)
    _edit(tree, lambda d: (d["timing"].__setitem__("warmup", 1), d["kernels"].__setitem__("gencode", "-arch=sm_90")))
    with pytest.raises(ConfigError, match=r"'kernels\.gencode'"):
        load_config(root=tree)


def test_unknown_profile_and_missing_file(tree):
    with pytest.raises(ConfigError, match="profile"):
        load_config(profile="tpu", root=tree)
    with pytest.raises(ConfigError, match="not found"):
        load_config(config_path=tree / "nope.yaml", root=tree)


def test_overrides_are_validated_too():
    with pytest.raises(ConfigError, match=r"'seed'"):
        load_config(root=ROOT, overrides={"seed": -1})
    cfg = load_config(root=ROOT, overrides={"seed": 5})
    assert cfg.seed == 5


def test_cli_reports_bad_config_clearly(tree, capsys, monkeypatch):
    from kmesh.cli import main

    _edit(tree, lambda d: d["model"]["smollm2"].__setitem__("max_new_tokens", 0))
    monkeypatch.setenv("KMESH_ROOT", str(tree))
    assert main(["run", "kernels"]) == 2
    err = capsys.readouterr().err
    assert "model.smollm2.max_new_tokens" in err and "minimum" in err


def _edit_profile(tree, profile, fn):
    p = tree / "config" / "profiles" / f"{profile}.yaml"
    data = yaml.safe_load(p.read_text()) or {}
    fn(data)
    p.write_text(yaml.safe_dump(data))


def test_skip_allowance_needs_a_case_pattern_and_a_reason(tree):
    _edit_profile(tree, "cpu", lambda d: d.setdefault("kernels", {}).__setitem__("allow_skips", [{"case": "load:*"}]))
    with pytest.raises(ConfigError, match=r"'kernels\.allow_skips\.0'.*'reason'"):
        load_config(root=tree)
    _edit_profile(tree, "cpu", lambda d: d["kernels"].__setitem__("allow_skips", [{"case": "", "reason": "x"}]))
    with pytest.raises(ConfigError, match=r"'kernels\.allow_skips\.0\.case'"):
        load_config(root=tree)


def test_skip_allowance_belongs_to_a_profile_not_to_the_shared_config(tree):
    # An allowance in config.yaml would hold for every profile; each profile must say what it may skip.
    _edit(tree, lambda d: d["kernels"].__setitem__("allow_skips", [{"case": "load:*", "reason": "x"}]))
    with pytest.raises(ConfigError, match=r"kernels\.allow_skips.*config/profiles/"):
        load_config(root=tree)


def test_each_profile_allows_exactly_its_legitimate_skips():
    def allowed(profile):
        cfg = load_config(profile=profile, root=ROOT)
        return {(stage, a["case"]) for stage, sec in cfg.data.items() if isinstance(sec, dict)
                for a in sec.get("allow_skips", [])}

    from kmesh.stages.peers.stage import ENGINE_CASES as PEER_CASES
    from kmesh.stages.remote.stage import CASES as REMOTE_CASES
    from kmesh.stages.vllm.stage import ENGINE_CASES

    assert allowed("cpu") == {("kernels", "load:*"), ("integrity", "gpu-digests"),
                              ("integrity", "bench-big-gpu-sha256"), ("model", "qwen2-checkpoint"),
                              ("restore_bench", "child-restore")}   # the one-launch restore is a GPU measurement
    # a switch the profile turns off (model.smollm2.enabled, vllm.enabled) skips its cases: allowed here, with why
    assert allowed("cuda") == {("sources", "fetch-*"), ("sources", "unpack-*"), ("sources", "installed-*"),
                               ("storage", "arrival-direct"),   # only when cuFile cannot run there
                               ("model", "smollm2-*"), ("model", "qwen2-checkpoint"),
                               ("reliability", "churn"),        # engine churn needs the CPU vLLM
                               *(("vllm", case_id) for case_id in ENGINE_CASES),
                               *(("peers", case_id) for case_id in PEER_CASES),   # neither vLLM nor LMCache there
                               *(("remote", case_id) for case_id in ("setup", *REMOTE_CASES))}   # no Mooncake there


def test_overlay_changes_sizes_and_is_recorded(tmp_path):
    from kmesh.config import load_config

    plain = load_config(profile="cpu")
    reduced = load_config(profile="cpu", overlays=["config/overlays/test.yaml"])
    assert reduced.data["timing"]["warmup"] < plain.data["timing"]["warmup"]
    assert reduced.data["reliability"]["crash"]["kills"] < plain.data["reliability"]["crash"]["kills"]
    assert reduced.data["overlays"] == ["config/overlays/test.yaml"] and "overlays" not in plain.data
    assert reduced.digest() != plain.digest()   # the config hash in every result says an overlay ran
    # an overlay never widens what a stage may skip
    assert reduced.skip_allowances("kernels") == plain.skip_allowances("kernels")


@pytest.mark.parametrize("text, why", [
    ("kernels: {allow_skips: [{case: 'compile:*', reason: 'an overlay hiding failures'}]}", "skip allowances"),
    ("profile: cuda", "may not set 'profile'"),
    ("- a list", "mapping at top level"),
])
def test_overlay_cannot_allow_skips_or_switch_profile(tmp_path, text, why):
    from kmesh.config import load_config
    from kmesh.errors import ConfigError

    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=why):
        load_config(profile="cpu", overlays=[bad])
    with pytest.raises(ConfigError, match="overlay file not found"):
        load_config(profile="cpu", overlays=[tmp_path / "missing.yaml"])


def test_overlays_are_found_by_name_and_an_unknown_name_lists_them():
    from kmesh.config import load_config, overlay_file

    assert overlay_file("long") == "config/overlays/long.yaml"
    assert overlay_file("config/overlays/test.yaml") == "config/overlays/test.yaml"
    assert load_config(profile="cpu", overlays=["test"]).data["overlays"] == ["config/overlays/test.yaml"]
    with pytest.raises(ConfigError, match=r"overlay file not found: lon .*'long'.*'test'"):
        overlay_file("lon")


def test_the_long_overlay_puts_back_every_size_the_cpu_profile_reduces():
    """Smaller, not fewer: every size the cpu profile sets below config.yaml's is the long overlay's again, or
    longer (the long forms: soak, fuzz, kills)."""
    import yaml

    from kmesh.config import deep_merge, load_config

    base = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cpu = load_config(profile="cpu").data
    long = load_config(profile="cpu", overlays=["long"]).data

    def numbers(d, path=()):
        for k, v in d.items():
            if isinstance(v, dict):
                yield from numbers(v, (*path, k))
            elif isinstance(v, (int, float, list)) and not isinstance(v, bool):
                yield (*path, k), v

    def at(d, path):
        for k in path:
            d = d[k]
        return d

    reduced = [p for p, v in numbers(deep_merge(base, {})) if p[0] != "allow_skips" and _has(cpu, p)
               and at(cpu, p) != v]
    assert reduced, "the cpu profile reduces nothing"
    for p in reduced:
        if p[-1] in ("device", "threads_bind"):
            continue
        assert _has(long, p), p
        want, got = at(base, p), at(long, p)
        assert got == want or (isinstance(got, (int, float)) and got > want) or p[-1] == "rate_ops_per_s", \
            (".".join(map(str, p)), "config.yaml", want, "long", got, "cpu", at(cpu, p))


def _has(d, path):
    for k in path:
        if not isinstance(d, dict) or k not in d:
            return False
        d = d[k]
    return True
