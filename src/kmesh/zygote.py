"""Processes forked from a zygote: one process that has imported what they all import, then forks each on request.

Why: a vLLM engine start on the 2-core machine costs ~21 CPU-s, ~12 of them importing vLLM; an engine forked from a
process that has already imported it costs ~8 (measured, same model and settings). A stage starts 3 to 8 engines.
A cache-service process costs ~1.2 CPU-s, nearly all of it `import torch`, and the suite starts ~60 of them.

    zy = zygote_for(env, preload=("vllm", ...))        # one per preload list in this process (and its environment)
    proc = zy.spawn("kmesh.vllm.engine:_serve", env, stderr=log_fd)   # a Popen-like ForkedProcess
    proc = zy.spawn("kmesh.service.server:main", env, argv=[...], cwd=..., stdin=fd, stdout=fd, stderr=fd)

The zygote is a real process (`python -m kmesh.zygote MODULE...`), started with the children's environment
(less PER_CHILD's variables), because modules read some variables once, at import (vLLM its logging level, torch
its compile switch): children of one zygote differ only in PER_CHILD's (TMPDIR, pytest's test name), which a child
sets before anything reads them. A child is a
real process of its own: its stdin and stdout are pipes to the caller (or the files the caller gives), its stderr
the caller's log, its environment, working directory and sys.argv the caller's; the zygote reports its exit status.
Forking is safe only from a process with one thread: the zygote reports its thread count when ready, and a zygote
whose imports started a thread is not used (`ZygoteError`; the caller starts its process the ordinary way). torch's
import starts an OpenMP thread where the environment asks for more than one, so a zygote imports with one, and each
child sets torch's intra-op threads from its own environment (torch's rule: MKL_NUM_THREADS over OMP_NUM_THREADS).
The zygote ends when its caller closes the channel or dies.
"""
from __future__ import annotations

import atexit
import fcntl
import gc
import importlib
import json
import os
import queue
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from typing import Any

from kmesh.errors import KMeshError

_FD_VAR = "KMESH_ZYGOTE_FD"
_THREADS_VAR = "KMESH_ZYGOTE_ONE_THREAD"
BLAS_POOL_VARS = ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS",
                  "BLIS_NUM_THREADS")    # the zygote imported with one OpenMP thread: children set theirs
_MAX_MSG = 1 << 20
MAX_KEEP_FDS = 8         # descriptors a child may keep at the caller's numbers (Popen's pass_fds)
_FD_PARKING = 512        # where a child's descriptors wait before they are placed at their numbers
_EXIT_REPORT_S = 10.0    # how long a child's exit status may take to come from the zygote once the child has ended


class ZygoteError(KMeshError):
    """The zygote could not start, is not safe to fork from, or did not answer."""


class ForkedProcess:
    """The part of subprocess.Popen that callers use, for a child of a zygote (text-mode stdin/stdout pipes).

    The zygote, not the caller, reaps the child, so its pid may be free (and reused) before the caller hears of the
    exit: signals go through a pidfd the zygote opened before it could reap (never a bare pid), and the pidfd also
    tells at once that the child has ended, as Popen.poll's waitpid does, where the zygote's report comes a moment
    later."""

    def __init__(self, zygote: "Zygote", pid: int, stdin_fd: int | None, stdout_fd: int | None,
                 pidfd: int) -> None:
        self._zygote, self.pid = zygote, pid
        # pipes to the child, where the caller gave no file of its own (as Popen's stdin=PIPE / stdout=PIPE)
        self.stdin = os.fdopen(stdin_fd, "w") if stdin_fd is not None else None
        self.stdout = os.fdopen(stdout_fd, "r") if stdout_fd is not None else None
        self.pidfd = pidfd
        self._close_pidfd = weakref.finalize(self, os.close, pidfd)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._zygote.exit_code(self.pid)
            if self.returncode is None and select.select([self.pidfd], [], [], 0)[0]:
                # ended: its status follows from the zygote (255 if the zygote went first: unknown)
                self.returncode = self._zygote.wait_exit(self.pid, _EXIT_REPORT_S)
                if self.returncode is None:
                    self.returncode = 255
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self._zygote.wait_exit(self.pid, timeout)
            if code is None:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                signal.pidfd_send_signal(self.pidfd, sig)
            except ProcessLookupError:      # it ended meanwhile, as with Popen's
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    def __init__(self, env: dict[str, str], preload: tuple[str, ...], start_timeout_s: float = 240.0) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.preload = preload
        self._stderr = tempfile.TemporaryFile()     # a file, not a pipe: what the imports print cannot block it
        own = {**env, _FD_VAR: str(theirs.fileno())}
        if any(_positive(env.get(name)) > 1 for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")):
            # torch's import runs an OpenMP region: with more than one thread that starts a pool no fork can copy
            # (the zygote would be refused). It imports with one; each child sets what its environment asks for.
            own.update({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", _THREADS_VAR: "1"})
        # The BLAS libraries numpy loads start their pools at import as these ask (Snakemake sets every one of them
        # to a job's threads): with more than one the zygote would be refused and every engine would import vLLM
        # itself (found under Snakemake: three engines 17 -> 49 s). The children's numpy BLAS stays at one thread;
        # their compute is torch's, whose threads each child sets.
        own.update({name: "1" for name in BLAS_POOL_VARS if _positive(env.get(name)) > 1})
        self.proc = subprocess.Popen([sys.executable, "-m", "kmesh.zygote", *preload],
                                     env=own, pass_fds=(theirs.fileno(),),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._stderr)
        theirs.close()
        self._sock = ours
        self._send_lock = threading.Lock()
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._cond = threading.Condition()
        self._exits: dict[int, int] = {}
        self._live: set[int] = set()
        self._closed = False
        self.retired = False
        threading.Thread(target=self._read, name=f"zygote-{self.proc.pid}", daemon=True).start()
        first = self._reply("start", start_timeout_s)
        if "error" in first:
            self.close()
            raise ZygoteError(f"zygote could not import {list(preload)}: {first['error']}\n{self._stderr_tail()}")
        if first["threads"] != 1:
            # a fork copies only the forking thread: a lock another thread held stays locked in every child
            self.close()
            raise ZygoteError(f"zygote has {first['threads']} threads after importing {list(preload)}: not safe to "
                              "fork from")

    def _read(self) -> None:
        while True:
            try:
                data, fds, _, _ = socket.recv_fds(self._sock, _MAX_MSG, 1)
            except OSError:
                data, fds = b"", []
            if not data:
                for fd in fds:
                    os.close(fd)
                break
            msg = json.loads(data)
            if fds:
                msg["pidfd"] = fds[0]      # a fork's reply: the child's pidfd
            if "exit" in msg:
                with self._cond:
                    self._exits[msg["exit"]] = msg["code"]
                    self._live.discard(msg["exit"])
                    self._cond.notify_all()
                    idle = self.retired and not self._live
                if idle:
                    self.close()
            else:
                self._replies.put(msg)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._replies.put({"error": "the zygote closed its channel"})

    def _reply(self, what: str, timeout_s: float) -> dict[str, Any]:
        try:
            return self._replies.get(timeout=timeout_s)
        except queue.Empty:
            raise ZygoteError(f"zygote (pid {self.proc.pid}) did not answer {what!r} within {timeout_s:g} s:\n"
                              f"{self._stderr_tail()}") from None

    def _stderr_tail(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-3000:]

    def spawn(self, entry: str, env: dict[str, str], stderr: int | None = None, timeout_s: float = 60.0, *,
              argv: list[str] | None = None, cwd: str | os.PathLike | None = None, stdin: int | None = None,
              stdout: int | None = None, pass_fds: tuple[int, ...] = ()) -> ForkedProcess:
        """Fork a child that runs `entry` ("module:function", its return value the exit status) with `env`, in `cwd`
        (default: the caller's working directory now), with sys.argv[1:] = `argv`. stdin / stdout: file descriptors
        the child gets as its own (None: a pipe to the caller, the ForkedProcess's stdin / stdout); stderr: the
        caller's log (None: /dev/null); pass_fds: descriptors the child has at the same numbers (as Popen's; a
        number the zygote itself holds is refused with ZygoteError). The caller keeps its descriptors (the child has
        its own copies)."""
        if len(pass_fds) > MAX_KEEP_FDS:
            raise ZygoteError(f"{len(pass_fds)} descriptors to keep: at most {MAX_KEEP_FDS}")
        pipes: list[int] = []                    # the caller's ends of the pipes it asked for
        theirs: list[int] = []                   # what the child gets as 0, 1, 2, then at pass_fds' numbers
        opened: list[int] = []                   # closed here once sent
        try:
            for given, child_reads in ((stdin, True), (stdout, False)):
                if given is not None:
                    theirs.append(given)
                    continue
                r, w = os.pipe()
                child_end, our_end = (r, w) if child_reads else (w, r)
                theirs.append(child_end)
                opened.append(child_end)
                pipes.append(our_end)
            if stderr is None:
                stderr = os.open(os.devnull, os.O_WRONLY)
                opened.append(stderr)
            theirs.append(stderr)
            theirs.extend(pass_fds)
            with self._send_lock:
                if self._closed or self.retired:
                    raise ZygoteError("the zygote is retired or gone")
                msg = json.dumps({"entry": entry, "env": env, "argv": list(argv or []), "keep_fds": list(pass_fds),
                                  "cwd": os.fspath(cwd if cwd is not None else os.getcwd())}).encode()
                try:
                    socket.send_fds(self._sock, [msg], theirs)
                except OSError as e:      # the zygote died (killed from outside): the caller may start otherwise
                    raise ZygoteError(f"zygote (pid {self.proc.pid}) is gone: {e}") from e
                reply = self._reply("fork", timeout_s)
            if "pid" not in reply or "pidfd" not in reply:
                if "pidfd" in reply:
                    os.close(reply["pidfd"])
                raise ZygoteError(f"zygote could not fork: {reply.get('error')}")
            with self._cond:
                if reply["pid"] not in self._exits:
                    self._live.add(reply["pid"])
        except BaseException:
            for fd in pipes:
                os.close(fd)
            raise
        finally:
            for fd in opened:
                os.close(fd)
        it = iter(pipes)
        return ForkedProcess(self, reply["pid"], next(it) if stdin is None else None,
                             next(it) if stdout is None else None, reply["pidfd"])

    def exit_code(self, pid: int) -> int | None:
        with self._cond:
            return self._exit_code_locked(pid)

    def wait_exit(self, pid: int, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while (code := self._exit_code_locked(pid)) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(timeout=0.5 if left is None else min(left, 0.5))
            return code

    def _exit_code_locked(self, pid: int) -> int | None:
        if pid in self._exits:
            return self._exits[pid]
        if self._closed and not _alive(pid):
            return 255              # the zygote went before it could say (killed from outside): status unknown
        return None

    def retire(self) -> None:
        """Fork nothing more; close the channel (the zygote ends) once every child has exited."""
        with self._cond:
            self.retired = True
            idle = not self._live
        if idle:
            self.close()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _intraop_threads(env: dict[str, str]) -> int | None:
    """torch's intra-op threads for a process started with `env`, where the environment sets them: OMP_NUM_THREADS,
    overridden by MKL_NUM_THREADS (torch's own rule); None where neither is a positive number."""
    n = None
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if _positive(env.get(name)) > 0:
            n = _positive(env.get(name))
    return n


def _positive(value: str | None) -> int:
    """A thread count from the environment; 0 for none or a value that is not a positive number."""
    try:
        return max(int(value or ""), 0)
    except ValueError:
        return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# Variables that differ from child to child and that no import reads, so children of one zygote may differ in them:
# TMPDIR (tempfile reads it again in each child) and pytest's name of the running test (a new one each test).
PER_CHILD = frozenset({"TMPDIR", "PYTEST_CURRENT_TEST"})
_zygotes: dict[tuple, Zygote] = {}
_zygotes_lock = threading.Lock()


def zygote_for(env: dict[str, str], preload: tuple[str, ...]) -> Zygote:
    """This process's zygote for `env` (PER_CHILD aside) and `preload`, started on first use. The zygote of the same
    preload for another environment is retired (one idle zygote per kind, e.g. one of vLLM's size and one of the
    cache service's, per caller at most). The zygote itself runs in this process's TMPDIR; each child in the TMPDIR
    of its own `env`."""
    key = (tuple(sorted((k, v) for k, v in env.items() if k not in PER_CHILD)), preload)
    with _zygotes_lock:
        zy = _zygotes.get(key)
        if zy is not None and not zy.retired and not zy._closed and zy.proc.poll() is None:
            return zy
        for other_key in [k for k in _zygotes if k[1] == preload]:
            _zygotes.pop(other_key).retire()
        own = {k: v for k, v in env.items() if k not in PER_CHILD}
        if "TMPDIR" in os.environ:
            own["TMPDIR"] = os.environ["TMPDIR"]
        zy = Zygote(own, preload)
        _zygotes[key] = zy
        return zy


@atexit.register
def close_all() -> None:
    """End this process's zygotes (and wait for them: what their children spent is then counted as ours)."""
    with _zygotes_lock:
        zygotes = list(_zygotes.values())
        _zygotes.clear()
    for zy in zygotes:
        zy.close()


# --------------------------------------------------------------------------------------------------
# inside the zygote

def _child(req: dict[str, Any], fds: list[int], keep_closed: list[int]) -> None:
    """In the forked child: never returns."""
    code = 1
    try:
        gc.enable()                        # the zygote's objects stay frozen (see _main); this child's are collected
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in keep_closed:
            os.close(fd)
        # stdin, stdout, stderr at 0-2, then each kept descriptor at the number the caller gave it; all moved out of
        # the way first, so that no descriptor lands on one not yet placed
        targets = [0, 1, 2, *req["keep_fds"]]
        parking = max(_FD_PARKING, max(targets) + 1)   # above every number to place: no placing lands on a parked one
        moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, parking) for fd in fds]
        for fd in fds:
            os.close(fd)
        for target, fd in zip(targets, moved):
            os.dup2(fd, target)
        for fd in moved:
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        if _one_thread_import and "torch" in sys.modules and _intraop_threads(os.environ):
            sys.modules["torch"].set_num_threads(_intraop_threads(os.environ))   # what its environment asks for
        os.chdir(req["cwd"])
        sys.argv = [req["entry"], *req["argv"]]
        tempfile.tempdir = None            # read TMPDIR again: this child's own
        sys.stdin = open(0, "r", closefd=False)
        sys.stdout = open(1, "w", closefd=False)
        module, _, func = req["entry"].partition(":")
        code = getattr(importlib.import_module(module), func)()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code if isinstance(code, int) else 0)


_one_thread_import = False


def _main(preload: list[str]) -> int:
    global _one_thread_import
    sock = socket.socket(fileno=int(os.environ.pop(_FD_VAR)))
    _one_thread_import = os.environ.pop(_THREADS_VAR, None) is not None
    sys.stdout = sys.stderr                 # what the imports print (and loggers they set up) goes to stderr
    # The imports' objects (vLLM's and torch's: millions) are frozen out of the cyclic GC before any fork, as
    # Python's gc docs advise for fork without exec: a child's collections would otherwise scan all of them again
    # and write to every one's GC header, copying the zygote's pages into each child (measured in the peers stage:
    # ~10 % of its CPU in gc_collect_main and copy-on-write faults). Disabled until then, so no collection runs
    # between the imports and leaves freed holes in those pages.
    gc.disable()
    try:
        for name in preload:
            importlib.import_module(name)
    except BaseException as e:
        sock.send(json.dumps({"error": f"{type(e).__name__}: {e}"}).encode())
        return 1
    gc.freeze()
    # native threads too (an OpenMP pool, a library's helper): /proc counts every thread of the process
    sock.send(json.dumps({"threads": len(os.listdir("/proc/self/task")), "pid": os.getpid()}).encode())
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while True:                          # reap every child that ended, and say so
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())
        if sock in ready:
            try:
                data, fds, _, _ = socket.recv_fds(sock, _MAX_MSG, 3 + MAX_KEEP_FDS)
            except ConnectionResetError:
                data, fds = b"", []
            if not data:
                return 0                     # the caller closed the channel or died
            try:
                req = json.loads(data)
                req.setdefault("keep_fds", [])
                if len(fds) != 3 + len(req["keep_fds"]):
                    raise ZygoteError(f"{len(fds)} descriptors came for 3 + {len(req['keep_fds'])}")
                # a kept descriptor's number must be free in the child: one the zygote holds (a library's file, its
                # own stderr) would be replaced under it; the caller then starts its process the ordinary way
                held = {int(n) for n in os.listdir("/proc/self/fd")} - set(fds) - {sock.fileno(), wake_r, wake_w}
                clash = sorted(set(req["keep_fds"]) & (held | {0, 1, 2}))
                if clash:
                    raise ZygoteError(f"descriptor number(s) {clash} are in use in the zygote")
                sys.stderr.flush()
                gc.freeze()                  # what the loop allocated since, too (little)
                pid = os.fork()
                if pid == 0:
                    _child(req, fds, [sock.fileno(), wake_r, wake_w])
                try:     # before this loop can reap it: the child is at worst a zombie, so this pidfd is surely its
                    pidfd = os.pidfd_open(pid)
                except OSError:
                    os.kill(pid, signal.SIGKILL)       # not yet reaped: this pid is still the child's
                    raise
                reply: dict[str, Any] = {"pid": pid}
            except Exception as e:
                reply, pidfd = {"error": f"{type(e).__name__}: {e}"}, None
            finally:
                for fd in fds:
                    os.close(fd)
            if pidfd is None:
                sock.send(json.dumps(reply).encode())
            else:
                socket.send_fds(sock, [json.dumps(reply).encode()], [pidfd])
                os.close(pidfd)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
