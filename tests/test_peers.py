"""The peers stage's parts without an engine: LMCache's real MP server (started as the stage starts it), its own
statistics as the stage reads them, and the engine process's bounded replies. The whole stage (three engines) runs in
make test's pipeline (stage peers)."""
from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

from kmesh.result import Case
from kmesh.stages.peers.lmcache_server import METRICS, LMCacheServer, Mark, parse_metrics
from kmesh.vllm.engine import WORKAROUNDS, EngineError, EngineProcess, EngineTimeout, llm_kwargs

SETTINGS = {"chunk_size": 256, "l1_size_gb": 0.05, "eviction_policy": "LRU", "transfer_mode": "auto",
            "worker_reap_timeout_s": 30.0, "engine_extra": {"lmcache.mp.mq_timeout": 5.0}}
needs_lmcache = pytest.mark.skipif(importlib.util.find_spec("lmcache") is None, reason="LMCache is not installed")


def test_parse_metrics_sums_label_sets_and_ignores_the_rest():
    text = "\n".join([
        "# HELP lmcache_mp_lookup_hit_tokens_total hits",
        "# TYPE lmcache_mp_lookup_hit_tokens_total counter",
        'lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="a"} 256.0',
        'lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="b"} 512.0',
        'lmcache_mp_lookup_hit_tokens_created{model_name="a"} 1.7e9',     # not a counter we read
        "lmcache_mp_l1_write_chunks_total 3",
        'lmcache_mp_l1_read_chunks_total{l1_tag="_default"} 2.0',
    ])
    got = parse_metrics(text)
    assert got["lookup_hit_tokens"] == 768 and got["l1_write_chunks"] == 3 and got["l1_read_chunks"] == 2
    assert got["lookup_requested_tokens"] == 0 and set(got) == set(METRICS)


def test_counted_reads_its_own_log_lines_since_the_mark(tmp_path):
    server = LMCacheServer(tmp_path, SETTINGS)
    server.generation = 1                 # as after start(): the log of the first server generation
    server.log_path.write_text("x Stored 768 tokens in 0.8 seconds\n")
    mark = server.mark()
    with open(server.log_path, "a") as f:
        f.write("\x1b[32mLMCache INFO:\x1b[0m Retrieved 512 tokens in 0.3 seconds (engine_driven_transfer.py)\n"
                "Stored 256 tokens in 0.1 seconds\nRetrieved 256 tokens in 0.1 seconds\n")
    got = server.counted(mark, settle_s=0.5, quiet_s=0.2)
    assert got == {"stored_tokens_logged": 256, "retrieved_tokens_logged": 768}
    # a mark from an earlier server generation counts this generation's log from its start
    assert server.counted(Mark(0, 0, {}), settle_s=0.5)["stored_tokens_logged"] == 1024


# The stage asserts the same of its own server: fresh and empty with every counter exported (setup), killed with its
# ports closed (fault-server-killed-mid-load), started again as a new generation on its address (fault-server-restarted)
@pytest.mark.covered_by_stage("peers", "setup", "fault-server-killed-mid-load", "fault-server-restarted")
@needs_lmcache
def test_real_lmcache_server_on_loopback_answers_status_and_metrics_then_dies_by_kill(tmp_path):
    server = LMCacheServer(tmp_path, SETTINGS)
    try:
        started = server.start()
        assert started > 0 and server.alive()
        st = server.status()
        assert st["healthy"] is True and st["chunk_size"] == 256 and st["instances"] == [] and st["l1_objects"] == 0
        assert set(server.metrics()) == set(METRICS)
        mark = server.mark()
        assert server.counted(mark, settle_s=0.5)["lookup_hit_tokens"] == 0
        assert server.kill() == -9 and not server.alive()
        with pytest.raises(OSError):
            server.status()
        # a restart is a new generation with a new log, on the same address
        port = server.port
        server.start()
        assert server.generation == 2 and server.port == port and server.status()["healthy"] is True
    finally:
        server.kill()


def test_engine_reply_is_awaited_with_a_bound(tmp_path):
    # vLLM takes seconds to import and start: a 0.2 s bound on the start reply must raise, not block
    (tmp_path / "unloadable").mkdir()
    (tmp_path / "unloadable" / "config.json").write_text("{}")     # accepted; vLLM could never load it
    # spawned, not forked: a zygote would import vLLM first (~12 CPU-s) for a test that never lets an engine start
    eng = EngineProcess(tmp_path / "unloadable", None, start_timeout_s=0.2, log_path=tmp_path / "engine.log",
                        wait=False, zygote=False)
    try:
        t0 = time.monotonic()
        with pytest.raises(EngineTimeout, match="did not answer 'start' within 0.2 s"):
            eng.ready()
        assert time.monotonic() - t0 < 30
    finally:
        assert eng.kill() == -9


def test_engine_refuses_an_unknown_workaround_and_two_connectors(tmp_path):
    with pytest.raises(EngineError, match="unknown engine workaround"):
        EngineProcess(tmp_path, None, workarounds=("patch_everything",))
    with pytest.raises(EngineError, match="one connector"):
        llm_kwargs("m", {"socket": "s"}, kv_transfer={"kv_connector": "LMCacheMPConnector"})
    assert "vllm_dispatcher_vars_nondict" in WORKAROUNDS
    kw = llm_kwargs("m", None, kv_transfer={"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"})
    assert kw["kv_transfer_config"]["kv_connector"] == "LMCacheMPConnector" and not kw["enable_prefix_caching"]


def test_every_arm_runs_in_one_environment_so_their_engines_share_one_zygote():
    """The zygotes are keyed by the engine's whole environment: the LMCache arm's extra variables must already be
    engine_env's, or each stage started three zygotes (~7 CPU-s of vLLM imports each) for its three arms."""
    from kmesh.stages.peers.servers import LMCachePeer
    from kmesh.vllm.engine import engine_env

    base = engine_env("0-1")
    assert {**base, **LMCachePeer.engine_env} == base
    assert LMCachePeer.engine_env["DO_NOT_TRACK"] == "1" and base["LMCACHE_TRACK_USAGE"] == "false"


def _children(pid: int) -> list[int]:
    """Live (not zombie) child processes of pid, from /proc."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            kids.append(int(stat.parent.name))
    return kids


def _left_processes(pid: int) -> list[int]:
    """pid's live child processes, less this process's idle zygotes (kmesh.zygote: they fork the stage's services and
    engines and outlive it by design), but with every process forked from them (those are what must not outlive)."""
    from kmesh import zygote

    zygotes = {zy.proc.pid for zy in zygote._zygotes.values()}
    left = [k for k in _children(pid) if k not in zygotes]
    return left + [k for z in zygotes for k in _children(z)]


@needs_lmcache
@pytest.mark.vllm
def test_stage_whose_engines_cannot_start_skips_the_rest_saying_why_and_leaves_no_process(tmp_path):
    from kmesh.config import load_config
    from kmesh.stages import peers
    from kmesh.stages.peers.stage import ENGINE_CASES

    pytest.importorskip("vllm")
    # no converted model there: both servers come up, the engines are refused before a process starts, the setup fails
    cfg = load_config(profile="cpu", overrides={"results_dir": str(tmp_path), "model": {"dir": str(tmp_path / "none")}})
    res = peers.run(cfg)
    by_id = {c.id: c for c in res.cases}
    assert list(by_id) == ["arms-alike", *ENGINE_CASES]
    assert by_id["setup"].passed is False and by_id["setup"].error
    assert all(by_id[c].skipped.startswith("setup did not pass") for c in ENGINE_CASES[1:])
    assert not res.summary()["ok"]
    assert _left_processes(os.getpid()) == [], "an engine or server process outlived the stage"




class _SpecPeer:
    def __init__(self, connector: str) -> None:
        self.connector = connector

    def engine_spec(self) -> dict:
        return {"kv_transfer_config": {"kv_connector": self.connector}}


def _applied(**over: object) -> dict:
    base = {"model": "/m", "dtype": "torch.float32", "enforce_eager": True, "max_model_len": 2048, "seed": 0,
            "max_num_batched_tokens": 2048, "enable_prefix_caching": False, "block_size": 16,
            "kv_cache_memory_bytes": 1 << 28, "compilation_mode": "NONE", "kv_connector": None,
            "kv_load_failure_policy": None, "threads_bind": "0-1", "torch_compile_disable": "1"}
    return {**base, **over}


def _engine_infos(**per_arm: dict) -> dict:
    infos = {"vllm": _applied(), "vllm-prefix": _applied(enable_prefix_caching=True),
             "lmcache": _applied(kv_connector="LMCacheMPConnector", kv_load_failure_policy="recompute"),
             "kmesh": _applied(kv_connector="KMeshConnector", kv_load_failure_policy="recompute")}
    for arm, over in per_arm.items():
        infos[arm] = {**infos[arm], **over}
    return {arm: {"applied": a} for arm, a in infos.items()}


@pytest.mark.parametrize("arm, over, failing", [
    (None, {}, set()),
    ("kmesh", {"enforce_eager": False}, {"same_applied_settings_but_connector_and_prefix_cache"}),
    ("lmcache", {"threads_bind": "0"}, {"same_applied_settings_but_connector_and_prefix_cache"}),
    ("vllm-prefix", {"enable_prefix_caching": False}, {"prefix_cache_on_only_in_vllm_prefix"}),
    ("kmesh", {"enable_prefix_caching": True}, {"prefix_cache_on_only_in_vllm_prefix"}),
    ("lmcache", {"kv_connector": "KMeshConnector"}, {"each_peer_runs_its_connector"}),
    ("vllm", {"kv_connector": "KMeshConnector"}, {"each_peer_runs_its_connector"}),
])
def test_the_engines_applied_settings_are_compared_as_each_reports_them(arm, over, failing):
    """setup's fairness checks read what each engine process applied (its vllm_config), so one arm running with
    another setting than the others fails by name; vLLM's prefix cache is on in vllm-prefix alone."""
    from kmesh.stages.peers.stage import _applied_settings

    case = Case("setup")
    peers = {"lmcache": _SpecPeer("LMCacheMPConnector"), "kmesh": _SpecPeer("KMeshConnector")}
    _applied_settings(case, _engine_infos(**({arm: over} if arm else {})), peers)
    assert {name for name, c in case.checks.items() if c["ok"] is False} == failing
    assert set(case.checks["applied_settings"]["value"]) == {"vllm", "vllm-prefix", "lmcache", "kmesh"}


def test_an_engine_that_reports_nothing_fails_the_comparison():
    from kmesh.stages.peers.stage import _applied_settings

    case = Case("setup")
    infos = {arm: {} for arm in ("vllm", "vllm-prefix", "lmcache", "kmesh")}
    _applied_settings(case, infos, {"lmcache": _SpecPeer("LMCacheMPConnector"), "kmesh": _SpecPeer("KMeshConnector")})
    assert case.checks["same_applied_settings_but_connector_and_prefix_cache"]["ok"] is False


def test_kill_evidence_needs_sigkill_and_every_address_closed(tmp_path):
    """`<peer>_server_was_killed` reads the exit status and whether the server's addresses still accept: a process
    that ended otherwise, or a port or socket still answering, is not a server gone."""
    import socket

    from kmesh.stages.peers.servers import accepts, kill_evidence

    tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp.bind(("127.0.0.1", 0))
    tcp.listen()
    port = tcp.getsockname()[1]
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    path = str(tmp_path / "s.sock")
    unix.bind(path)
    unix.listen()
    assert accepts(socket.AF_INET, ("127.0.0.1", port)) and accepts(socket.AF_UNIX, path)
    assert kill_evidence(-9, {"tcp": True})["server_gone"] is False
    tcp.close()
    unix.close()                                  # the socket file stays, nothing accepts on it
    assert not accepts(socket.AF_INET, ("127.0.0.1", port)) and not accepts(socket.AF_UNIX, path)
    assert kill_evidence(-9, {"tcp": False, "unix": False}) == {
        "exit_status": -9, "killed_by_sigkill": True, "still_accepting": {}, "server_gone": True}
    assert kill_evidence(0, {"tcp": False})["server_gone"] is False       # it exited on its own
    assert kill_evidence(None, {})["server_gone"] is False                 # it never ran


def test_a_kill_while_storing_is_judged_by_the_servers_own_listing():
    """fault-engine-killed-while-storing: what the interrupted request left against what one complete store of a
    same-length prompt added, from listings read until they settle (LMCache stores after the answer)."""
    from kmesh.stages.peers.stage import _store_outcome, _stored_objects

    assert [_store_outcome(added, 4) for added in (0, -1, 1, 3, 4, 5)] == \
        ["missing", "missing", "partial", "partial", "complete", "complete"]

    class Listing:   # a server whose asynchronous store lands between the first reads
        def __init__(self, counts, key):
            self.counts, self.key = list(counts), key

        def holdings(self, pids):
            return {self.key: self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]}

    assert _stored_objects(Listing([9, 10, 10], "l1_objects"), {}, settle_s=0.01) == 10
    assert _stored_objects(Listing([44, 44], "objects"), {}, settle_s=0.01) == 44
    assert _stored_objects(Listing([{"server": "down"}.get("objects", -1)], "objects"), {}, settle_s=0.01) == -1


def test_a_mid_load_kill_is_placed_by_each_systems_own_counters():
    """fault-server-killed-mid-load: before the load (no plan / no lookup hit), during it (planned, not delivered)
    or after it (all of it delivered), from the interrupted request's own counters (the evidence the case records;
    the values are those of real attempts)."""
    from kmesh.stages.peers.stage import landed_where

    kmesh = {"none": {"mode": "none", "tokens_supplied": 0, "load_errors": 0, "service": "down"},
             "half-planned": {"mode": "prefix", "stored_tokens": 128, "tokens_supplied": 0, "load_errors": 1},
             "planned": {"mode": "prefix", "stored_tokens": 256, "tokens_supplied": 0, "load_errors": 2},
             "delivered": {"mode": "prefix", "stored_tokens": 256, "tokens_supplied": 256, "load_errors": 0}}
    assert {k: landed_where("kmesh", v) for k, v in kmesh.items()} == \
        {"none": "before", "half-planned": "during", "planned": "during", "delivered": "after"}
    lmcache = {"no hit": {"lookup_hit_tokens": 0, "retrieved_tokens_logged": 0},
               "hit, nothing retrieved": {"lookup_hit_tokens": 256, "retrieved_tokens_logged": 0},
               "hit, part retrieved": {"lookup_hit_tokens": 256, "retrieved_tokens_logged": 128},
               "hit, all retrieved": {"lookup_hit_tokens": 256, "retrieved_tokens_logged": 256}}
    assert {k: landed_where("lmcache", v) for k, v in lmcache.items()} == \
        {"no hit": "before", "hit, nothing retrieved": "during", "hit, part retrieved": "during",
         "hit, all retrieved": "after"}
