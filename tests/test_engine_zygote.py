"""Engines forked from a zygote (kmesh.zygote): each child a process of its own, with its own environment,
TMPDIR, pipes and exit status. The zygotes here preload only kmesh.vllm.engine (no vLLM: a fork needs no engine to
show these); the pipeline's vllm, peers and reliability stages run real engines through it, and the test below
compares a forked engine's tokens and logprobs with a spawned one's where vLLM is installed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from kmesh import zygote
from kmesh.vllm import engine
from kmesh.zygote import ForkedProcess, Zygote, ZygoteError

PRELOAD = ("kmesh.vllm.engine",)
SERVE = "kmesh.vllm.engine:_serve"


def _ask(proc: ForkedProcess, op: str) -> dict:
    proc.stdin.write(json.dumps({"op": op}) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def zy():
    z = Zygote(dict(os.environ), PRELOAD)
    yield z
    z.close()


def test_each_child_runs_with_its_own_environment_and_tmpdir(zy, tmp_path):
    children = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        env = {**os.environ, "TMPDIR": str(tmp_path / name), "KMESH_ZYGOTE_TEST": name}
        children.append((env, zy.spawn(SERVE, env)))
    seen = [_ask(p, "environ")["result"] for _, p in children]
    for (env, proc), got in zip(children, seen):
        assert got["pid"] == proc.pid and proc.pid != zy.proc.pid
        assert got["environ"] == env                       # exactly what the caller gave, nothing of the zygote's
        assert got["tempdir"] == env["TMPDIR"]              # tempfile reads this child's TMPDIR, not a cached one
    assert seen[0]["pid"] != seen[1]["pid"]
    for _, proc in children:
        assert _ask(proc, "exit")["ok"] and proc.wait(timeout=10) == 0


def test_exit_status_poll_wait_and_kill_as_popen_reports_them(zy):
    proc = zy.spawn(SERVE, dict(os.environ))
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(timeout=0.2)
    assert _ask(proc, "no-such-op") == {"ok": False, "error": "ValueError: unknown op 'no-such-op'"}
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL and proc.poll() == -signal.SIGKILL
    # a child whose stdin closes ends by itself (the engine's serve loop ends with its input), status 0
    other = zy.spawn(SERVE, dict(os.environ))
    other.stdin.close()
    assert other.wait(timeout=10) == 0


def test_what_a_child_prints_goes_to_its_log_not_the_protocol_channel(zy, tmp_path):
    log = tmp_path / "child.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        proc = zy.spawn(SERVE, dict(os.environ), stderr=fd)
    finally:
        os.close(fd)
    assert not _ask(proc, "bad")["ok"]                     # its traceback is printed to stderr
    assert "ValueError: unknown op 'bad'" in log.read_text()
    proc.stdin.close()
    assert proc.wait(timeout=10) == 0


def test_a_child_collects_its_own_objects_but_never_scans_the_zygotes(tmp_path):
    """The zygote freezes what its imports made before it forks (gc.freeze): a child's collections then neither scan
    nor write to those objects (no copy-on-write of the zygote's pages); the child's own garbage is still collected."""
    (tmp_path / "gcstate.py").write_text(textwrap.dedent("""\
        import gc, json, os
        def main():
            class Cycle:
                pass
            a, b = Cycle(), Cycle()
            a.other, b.other = b, a
            del a, b
            found = gc.collect()
            with open(os.environ["GC_STATE"], "w") as f:
                json.dump({"enabled": gc.isenabled(), "frozen": gc.get_freeze_count(), "collected": found}, f)
            return 0
        """))
    env = {**os.environ, "GC_STATE": str(tmp_path / "gc.json"),
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    z = Zygote(env, PRELOAD)
    try:
        assert z.spawn("gcstate:main", env).wait(timeout=30) == 0
    finally:
        z.close()
    got = json.loads((tmp_path / "gc.json").read_text())
    assert got["enabled"] is True and got["collected"] >= 2
    assert got["frozen"] > 10_000, got            # kmesh.vllm.engine's imports (torch among them): frozen


def test_a_zygote_ends_when_its_caller_dies(tmp_path):
    caller = textwrap.dedent(f"""
        import os, sys
        from kmesh.zygote import Zygote
        z = Zygote(dict(os.environ), {PRELOAD!r})
        child = z.spawn({SERVE!r}, dict(os.environ))
        print(z.proc.pid, child.pid, flush=True)
        os.kill(os.getpid(), 9)
    """)
    out = subprocess.run([sys.executable, "-c", caller], capture_output=True, text=True, timeout=60)
    assert out.returncode == -signal.SIGKILL, out.stderr
    zygote_pid, child_pid = map(int, out.stdout.split())
    assert _gone(zygote_pid)              # its channel closed with the caller
    assert _gone(child_pid)               # the child's stdin closed too: its serve loop ended


def test_a_zygote_killed_from_outside_refuses_to_spawn_and_is_replaced(monkeypatch):
    monkeypatch.setattr(zygote, "_zygotes", {})
    first = zygote.zygote_for(dict(os.environ), PRELOAD)
    first.proc.kill()
    first.proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while not first._closed and time.monotonic() < deadline:
        time.sleep(0.01)
    assert first._closed
    with pytest.raises(ZygoteError, match="retired or gone"):
        first.spawn(SERVE, dict(os.environ))
    first._closed = False      # the window before the channel's reader has seen the end: the send itself fails
    with pytest.raises(ZygoteError, match="is gone"):
        first.spawn(SERVE, dict(os.environ))
    second = zygote.zygote_for(dict(os.environ), PRELOAD)
    try:
        assert second is not first
        child = second.spawn(SERVE, dict(os.environ))
        child.stdin.close()
        assert child.wait(timeout=10) == 0
    finally:
        second.close()


def test_a_zygote_whose_imports_start_a_thread_is_refused(tmp_path):
    (tmp_path / "threaded_import.py").write_text("import threading, time\n"
                                                  "threading.Thread(target=time.sleep, args=(60,), "
                                                  "daemon=True).start()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    with pytest.raises(ZygoteError, match="has 2 threads after importing .*threaded_import.*not safe to fork"):
        Zygote(env, ("threaded_import",))
    with pytest.raises(ZygoteError, match="could not import .*no_such_module.*ModuleNotFoundError"):
        Zygote(dict(os.environ), ("no_such_module",))


def test_an_engine_falls_back_to_an_ordinary_process_when_no_zygote_can_fork(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    monkeypatch.setattr(engine, "ZYGOTE_PRELOAD", ("no_such_module",))
    eng = engine.EngineProcess(tmp_path / "model", None, wait=False, log_path=tmp_path / "engine.log")
    try:
        assert isinstance(eng.proc, subprocess.Popen)
        assert "engine not forked from a zygote: zygote could not import" in (tmp_path / "engine.log").read_text()
    finally:
        eng.kill()


def test_another_environment_retires_the_zygote_once_its_children_end(monkeypatch):
    monkeypatch.setattr(zygote, "_zygotes", {})
    first = zygote.zygote_for(dict(os.environ), PRELOAD)
    assert zygote.zygote_for({**os.environ, "TMPDIR": "/elsewhere"}, PRELOAD) is first     # TMPDIR is per child
    child = first.spawn(SERVE, dict(os.environ))
    second = zygote.zygote_for({**os.environ, "KMESH_ZYGOTE_TEST": "other"}, PRELOAD)
    try:
        assert second is not first and first.retired and first.proc.poll() is None   # its child still runs
        with pytest.raises(ZygoteError, match="retired"):
            first.spawn(SERVE, dict(os.environ))
        child.stdin.close()
        assert child.wait(timeout=10) == 0
        assert first.proc.wait(timeout=10) == 0       # the last child gone, the retired zygote ends
    finally:
        second.close()


@pytest.mark.vllm
@pytest.mark.slow  # two engine starts (~30 CPU-s): make test-all; make test's vllm stage checks forked engines' tokens
def test_a_forked_engine_answers_as_a_spawned_one(monkeypatch):
    """Tokens and logprobs of one prompt, bit for bit, from an engine forked from the zygote and a spawned one."""
    from kmesh.config import load_config
    from kmesh.model import smollm2

    # as make test runs it: with more than one OpenMP thread torch's import starts a thread and no zygote forks
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    folder = smollm2.converted_dir(load_config(profile="cpu"))
    smollm2.ensure_converted(folder)
    got = {}
    for forked in (True, False):
        with engine.EngineProcess(folder, None, zygote=forked) as eng:
            assert isinstance(eng.proc, ForkedProcess) is forked
            got[forked] = eng.generate([[1, 2, 3, 4, 5, 6, 7, 8]], 8, logprobs=5)
    assert json.dumps(got[True], sort_keys=True) == json.dumps(got[False], sort_keys=True)


def test_a_stage_result_counts_the_cpu_of_processes_forked_from_its_zygote(tmp_path, monkeypatch):
    """Forked engines are the zygote's children, not the stage's: their CPU reaches the stage's getrusage only once
    the zygote is reaped, so writing a result ends this process's zygotes first."""
    import resource

    from kmesh.config import load_config
    from kmesh.result import Result

    (tmp_path / "burner.py").write_text("import time\ndef main():\n    t = time.process_time()\n"
                                        "    while time.process_time() - t < 0.5:\n        pass\n    return 0\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    monkeypatch.setattr(zygote, "_zygotes", {})

    def children_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    before = children_cpu()
    child = zygote.zygote_for(env, PRELOAD).spawn("burner:main", env)
    assert child.wait(timeout=30) == 0
    assert children_cpu() - before < 0.5               # reaped by the zygote, which still runs: not ours yet
    res = Result.begin("unit", load_config())
    res.write(tmp_path / "result.json")
    assert res.provenance["resources"]["children_cpu_s"] >= before + 0.5
    assert zygote._zygotes == {}
