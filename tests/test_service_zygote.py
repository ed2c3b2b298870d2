"""Cache-service processes forked from a zygote (kmesh.zygote), and what a zygote's child gets from its caller: argv,
working directory, the caller's own files as stdin/stdout, and signals through a pidfd (the zygote reaps the child,
so its bare pid may already belong to another process when the caller signals it).

make test starts ~100 services (~1.2 CPU-s each, nearly all `import torch`); forked from one process that has
imported the server, each costs ~0.01. Every other service test runs through this path too (it is the default)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kmesh import zygote
from kmesh.service import process
from kmesh.zygote import ForkedProcess, Zygote


@pytest.fixture
def own_zygotes(monkeypatch):
    """This test's zygotes only, ended afterwards; one OpenMP thread, as make test runs (two: the test below)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(zygote, "_zygotes", {})
    yield
    zygote.close_all()


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_service_is_forked_from_the_callers_service_zygote_and_stops_as_before(tmp_path, own_zygotes):
    first = process.start(tmp_path / "a")
    second = process.start(tmp_path / "b")
    try:
        assert isinstance(first.proc, ForkedProcess) and isinstance(second.proc, ForkedProcess)
        (zy,) = zygote._zygotes.values()                      # one zygote serves both
        assert zy.preload == process.ZYGOTE_PRELOAD
        assert _parent(first.pid) == _parent(second.pid) == zy.proc.pid != os.getpid()
        with first.client() as c:
            assert c.ping()["server_pid"] == first.pid
    finally:
        assert first.stop() == 0
        assert second.stop() == 0
    assert not first.alive() and not second.alive()


def test_services_of_successive_tests_share_one_zygote(tmp_path, own_zygotes, monkeypatch):
    """pytest names the running test in the environment; a zygote per test would cost what a spawn costs."""
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::one (call)")
    one = process.start(tmp_path / "one")
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/a.py::two (call)")
    two = process.start(tmp_path / "two")
    monkeypatch.setenv("KMESH_ZYGOTE_TEST", "another environment")      # what an import may read: a new zygote
    three = process.start(tmp_path / "three")
    try:
        assert _parent(one.pid) == _parent(two.pid) != _parent(three.pid)
    finally:
        for sp in (one, two, three):
            assert sp.stop() == 0


def test_a_service_forks_where_the_stage_runs_torch_on_two_threads(tmp_path, own_zygotes, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")           # what Snakemake exports to make pipeline's stages
    sp = process.start(tmp_path / "rt")
    try:
        assert isinstance(sp.proc, ForkedProcess)
        assert "not forked" not in sp.log_path.read_text()
    finally:
        assert sp.stop() == 0


def test_a_killed_forked_service_is_seen_ended_at_once_and_stop_signals_nothing_else(tmp_path, own_zygotes,
                                                                                  monkeypatch):
    sp = process.start(tmp_path / "rt")
    os.kill(sp.pid, signal.SIGKILL)               # as the reliability stage's crash case does
    deadline = time.monotonic() + 10
    while sp.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sp.alive()
    # the pid is the zygote's to reap (and then free for reuse): nothing may signal it by number any more

    def no_bare_kill(pid, sig):
        raise AssertionError(f"os.kill({pid}, {sig}) of a process this caller does not reap")

    monkeypatch.setattr(os, "kill", no_bare_kill)
    assert sp.stop() == -signal.SIGKILL
    sp.proc.kill()
    sp.proc.terminate()


def test_a_gated_service_keeps_its_gate_at_the_callers_descriptor_number(tmp_path, own_zygotes):
    gate_r, gate_w = os.pipe()
    try:
        sp = process.start(tmp_path / "gated", gate_fd=gate_r)      # `--gate-fd N`: the same N in the service
        try:
            assert isinstance(sp.proc, ForkedProcess)
            assert os.readlink(f"/proc/{sp.pid}/fd/{gate_r}") == os.readlink(f"/proc/self/fd/{gate_r}")
            with sp.client() as c:
                assert c.ping()["server_pid"] == sp.pid
        finally:
            assert sp.stop() == 0
    finally:
        os.close(gate_r)
        os.close(gate_w)


def test_the_service_zygote_is_left_out_where_asked_or_where_the_service_must_outlive_its_caller(tmp_path,
                                                                                               own_zygotes,
                                                                                               monkeypatch):
    off = process.start(tmp_path / "off", zygote=False)
    monkeypatch.setenv("KMESH_SERVICE_ZYGOTE", "0")
    by_env = process.start(tmp_path / "env")
    monkeypatch.delenv("KMESH_SERVICE_ZYGOTE")
    detached = process.start(tmp_path / "detached", detach=True)    # `kmesh service start`: its own session
    try:
        for sp in (off, by_env, detached):
            assert isinstance(sp.proc, subprocess.Popen) and _parent(sp.pid) == os.getpid()
        assert os.getsid(detached.pid) == detached.pid
        assert zygote._zygotes == {}
    finally:
        for sp in (off, by_env, detached):
            sp.stop()


def test_a_service_starts_the_ordinary_way_when_no_zygote_can_fork_and_says_so(tmp_path, own_zygotes,
                                                                               monkeypatch):
    monkeypatch.setattr(process, "ZYGOTE_PRELOAD", ("no_such_module",))
    sp = process.start(tmp_path / "rt")
    try:
        assert isinstance(sp.proc, subprocess.Popen)
        assert "service not forked from a zygote: zygote could not import" in sp.log_path.read_text()
        with sp.client() as c:
            assert c.ping()["server_pid"] == sp.pid
    finally:
        assert sp.stop() == 0


@pytest.fixture
def probe_zygote(tmp_path, monkeypatch):
    """A zygote whose preload is a probe module: main() prints its argv and working directory, exits with 3."""
    (tmp_path / "zygote_probe.py").write_text(
        "import json, os, sys, time\n"
        "def main():\n"
        "    print(json.dumps({'argv': sys.argv, 'cwd': os.getcwd()}), flush=True)\n"
        "    return 3\n"
        "def sleep():\n"
        "    time.sleep(60)\n"
        "def ready_then_sleep():\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(60)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    z = Zygote(dict(os.environ), ("zygote_probe",))
    yield z
    z.close()


def test_a_child_gets_the_callers_argv_and_working_directory(probe_zygote, tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")        # after the zygote started elsewhere: the caller's cwd now counts
    child = probe_zygote.spawn("zygote_probe:main", dict(os.environ), argv=["--runtime-dir", "rt", "-x"])
    got = json.loads(child.stdout.readline())
    assert got == {"argv": ["zygote_probe:main", "--runtime-dir", "rt", "-x"], "cwd": str(tmp_path / "here")}
    assert child.wait(timeout=10) == 3
    (tmp_path / "there").mkdir()
    other = probe_zygote.spawn("zygote_probe:main", dict(os.environ), cwd=tmp_path / "there")
    assert json.loads(other.stdout.readline())["cwd"] == str(tmp_path / "there")
    assert other.wait(timeout=10) == 3


def test_a_child_writes_to_the_file_the_caller_gives_and_the_caller_keeps_its_own(probe_zygote, tmp_path):
    out = open(tmp_path / "out.log", "ab")
    with open(os.devnull, "rb") as devnull:
        child = probe_zygote.spawn("zygote_probe:main", dict(os.environ), argv=["a"], stdin=devnull.fileno(),
                                   stdout=out.fileno(), stderr=out.fileno())
        assert child.stdin is None and child.stdout is None
        assert child.wait(timeout=10) == 3
        os.fstat(devnull.fileno())                 # still the caller's
    out.write(b"after\n")
    out.close()
    lines = (tmp_path / "out.log").read_text().splitlines()
    assert json.loads(lines[0])["argv"] == ["zygote_probe:main", "a"] and lines[1] == "after"


def test_descriptors_kept_at_high_numbers_land_where_asked(probe_zygote, tmp_path):
    """Numbers at and above where the child parks its descriptors before placing them (zygote._FD_PARKING)."""
    r, w = os.pipe()
    high = [zygote._FD_PARKING, zygote._FD_PARKING + 1]
    try:
        os.dup2(r, high[0])
        os.dup2(w, high[1])
        child = probe_zygote.spawn("zygote_probe:ready_then_sleep", dict(os.environ), pass_fds=tuple(high))
        try:
            assert child.stdout.readline() == "ready\n"     # its entry runs once every descriptor is in place
            for n in high:
                assert os.readlink(f"/proc/{child.pid}/fd/{n}") == os.readlink(f"/proc/self/fd/{n}")
        finally:
            child.kill()
            child.wait(timeout=10)
    finally:
        for fd in (r, w, *high):
            os.close(fd)


def test_a_descriptor_number_the_zygote_holds_is_refused_not_replaced(probe_zygote):
    with pytest.raises(zygote.ZygoteError, match=r"descriptor number\(s\) \[2\] are in use in the zygote"):
        probe_zygote.spawn("zygote_probe:main", dict(os.environ), pass_fds=(2,))
    child = probe_zygote.spawn("zygote_probe:main", dict(os.environ))        # the zygote serves on
    assert json.loads(child.stdout.readline())["argv"] == ["zygote_probe:main"] and child.wait(timeout=10) == 3


def test_signals_reach_the_child_through_its_pidfd_and_an_ended_child_is_left_alone(probe_zygote, monkeypatch):
    sleeper = probe_zygote.spawn("zygote_probe:sleep", dict(os.environ))
    real_kill = os.kill

    def no_bare_kill(pid, sig):
        if sig != 0:
            raise AssertionError(f"os.kill({pid}, {sig}): a zygote's child is signalled through its pidfd")
        return real_kill(pid, sig)

    monkeypatch.setattr(os, "kill", no_bare_kill)
    sleeper.terminate()
    assert sleeper.wait(timeout=10) == -signal.SIGTERM
    ended = probe_zygote.spawn("zygote_probe:main", dict(os.environ))
    ended.stdout.readline()
    deadline = time.monotonic() + 10
    while ended.poll() is None and time.monotonic() < deadline:   # the pidfd tells it ended
        time.sleep(0.01)
    assert ended.returncode == 3
    ended.kill()                                   # no signal, no error: as Popen.kill of an ended process
    assert ended.poll() == 3


@pytest.mark.parametrize("threads", [{"OMP_NUM_THREADS": "2"}, {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "1"},
                                     {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2"}])
def test_a_child_runs_torch_with_the_threads_its_environment_asks_for_as_a_spawned_process(tmp_path, monkeypatch,
                                                                                           threads):
    """make pipeline's stages run with 2 OpenMP threads: a zygote importing torch so would start a thread and could
    not fork; it imports with one and each child sets torch's intra-op threads from its own environment (torch's
    rule: MKL_NUM_THREADS over OMP_NUM_THREADS), the count a process started with that environment has."""
    (tmp_path / "torch_probe.py").write_text(
        "import json, os, torch\n"
        "def main():\n"
        "    a = torch.randn(512, 512)\n"
        "    (a @ a).sum()                      # a parallel region: its OpenMP team is this process's own\n"
        "    print(json.dumps({'threads': torch.get_num_threads(), 'tasks': len(os.listdir('/proc/self/task'))}),\n"
        "          flush=True)\n"
        "    return 0\n")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), **threads}
    spawned = subprocess.run([sys.executable, "-c", "import torch_probe; torch_probe.main()"], env=env,
                             capture_output=True, text=True, timeout=120, check=True)
    zy = Zygote(env, ("torch_probe",))              # refused (2 threads after the import) without the one-thread import
    try:
        child = zy.spawn("torch_probe:main", env)
        forked = json.loads(child.stdout.readline())
        assert child.wait(timeout=60) == 0
    finally:
        zy.close()
    want = json.loads(spawned.stdout)
    assert forked["threads"] == want["threads"] == int(threads.get("MKL_NUM_THREADS", threads["OMP_NUM_THREADS"]))
    assert (forked["tasks"] > 1) == (forked["threads"] > 1)    # a second thread ran the product where one should


def test_a_zygote_forks_under_snakemakes_thread_variables():
    """Snakemake exports a job's threads in every BLAS pool's variable. numpy's OpenBLAS starts its pool at import as
    OPENBLAS_NUM_THREADS asks: a zygote importing so had threads and was refused, and each vLLM engine of a stage
    imported vLLM itself (three engines 17 -> 49 s under make pipeline). The zygote imports with one."""
    env = {**os.environ, **{name: "2" for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                   "GOTO_NUM_THREADS", "VECLIB_MAXIMUM_THREADS",
                                                   "NUMEXPR_NUM_THREADS")}}
    zy = Zygote(env, ("numpy",))      # raises ZygoteError where its import left a thread pool
    try:
        child = zy.spawn("json.tool:main", env, argv=[])
        child.stdin.write("[1]\n")
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    finally:
        zy.close()
