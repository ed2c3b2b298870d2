"""Engine churn (issue 26 item 4): vLLM engine processes with KMeshConnector SIGKILLed mid-request, again and again.

    figures = run_churn(model_dir, ChurnSpec(kills=20), workdir, connector_extra)

One real service; a reference engine (connector on) generates greedily for a prompt first — its request saves the
prompt's KV through the connector — and the service's objects are noted with their digests. Then, per kill: a fresh
engine starts, is sent a long request (the prompt with a new suffix: a prefix load and a save), and is SIGKILLed
after a random delay while the request runs. The service must release every registration of the dead engine once
its heartbeat timeout passes (measured: seconds from the kill to released). After the last kill a new engine
generates for the prompt again: its tokens must equal the reference's, every object noted at the start must still
carry its digest (no shared original changed), the service must be alive with no registration of a killed engine.
"""
from __future__ import annotations

import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kmesh.errors import StageError


class ChurnError(StageError):
    """The churn could not run (an engine would not start)."""


@dataclass(frozen=True)
class ChurnSpec:
    kills: int = 20
    prompt_tokens: int = 384
    max_tokens: int = 96             # the killed request's length: long enough to be killed while it runs
    check_tokens: int = 16
    heartbeat_timeout_s: float = 3.0
    kill_after_s: tuple[float, float] = (0.2, 2.0)
    dtype: str = "float32"
    threads_bind: str = "0-1"
    seed: int = 26


def _objects(adm: Any) -> dict[bytes, str]:
    return {o["key"]: o["sha256"] for o in adm.status("all")["store"]["objects"]}


def _live_regs_of(adm: Any, pid: int) -> list[int]:
    st = adm.status("all")
    ids = {c["client"] for c in st["clients"] if c.get("pid") == pid}
    return [r["reg"] for r in st["registrations"] if r["client"] in ids]


def run_churn(model_dir: Path, spec: ChurnSpec, workdir: Path, connector_extra: dict[str, Any]) -> dict[str, Any]:
    from kmesh.service import process
    from kmesh.vllm.engine import EngineProcess

    rng = random.Random(spec.seed)
    prompt = [rng.randrange(100, 20000) for _ in range(spec.prompt_tokens)]
    workdir.mkdir(parents=True, exist_ok=True)
    sp = process.start(workdir / "rt", heartbeat_timeout_s=spec.heartbeat_timeout_s)
    extra = {**connector_extra, "socket": str(sp.socket_path)}
    common = dict(dtype=spec.dtype, threads_bind=spec.threads_bind)
    kills, problems = [], []
    try:
        with sp.admin_client(name="churn-admin") as adm:
            with EngineProcess(model_dir, extra, log_path=workdir / "engine-reference.log", **common) as ref:
                reference = ref.generate([prompt], max_tokens=spec.check_tokens)[0]["tokens"]
            noted = _objects(adm)
            if not noted:
                raise ChurnError("the reference request saved nothing through the connector")
            for i in range(spec.kills):
                eng = EngineProcess(model_dir, extra, log_path=workdir / f"engine-killed-{i}.log", **common)
                pid = eng.info["pid"]
                suffix = [rng.randrange(100, 20000) for _ in range(32)]
                eng._send({"op": "generate", "prompts": [prompt + suffix], "max_tokens": spec.max_tokens,
                           "params": [None], "logprobs": 0})
                time.sleep(rng.uniform(*spec.kill_after_s))
                still_running = eng.proc.poll() is None
                live_at_kill = len(_live_regs_of(adm, pid))
                os.kill(eng.proc.pid, signal.SIGKILL)
                t_kill = time.monotonic()
                eng.proc.wait()
                left = _live_regs_of(adm, pid)
                while left and time.monotonic() - t_kill < 3 * spec.heartbeat_timeout_s + 30:
                    time.sleep(0.1)
                    left = _live_regs_of(adm, pid)
                kills.append({"kill": i, "killed_while_running": still_running, "registrations_at_kill": live_at_kill,
                              "released_after_s": None if left else time.monotonic() - t_kill,
                              "left": left})
                if left:
                    problems.append({"kill": i, "registrations_not_released": left})
            with EngineProcess(model_dir, extra, log_path=workdir / "engine-after.log", **common) as after:
                tokens = after.generate([prompt], max_tokens=spec.check_tokens)[0]["tokens"]
            now = _objects(adm)
            changed = [k.hex()[:16] for k, sha in noted.items() if now.get(k) != sha]
            alive = sp.alive()
            final = adm.status("all")
            regs_left, internal = len(final["registrations"]), final["stats"]["internal_errors"]
    finally:
        sp.stop()
    released = [k["released_after_s"] for k in kills if k["released_after_s"] is not None]
    return {"spec": asdict(spec), "kills": len(kills), "killed_while_running": sum(k["killed_while_running"]
                                                                                   for k in kills),
            "registrations_released_every_kill": not problems, "release_s_max": max(released, default=None),
            "release_s": released, "tokens_equal_after_churn": tokens == reference,
            "reference_tokens": reference, "tokens_after": tokens, "originals_noted": len(noted),
            "originals_changed": changed, "service_alive": alive, "registrations_left": regs_left,
            "internal_errors": internal,
            "per_kill": kills, "problems": problems}
