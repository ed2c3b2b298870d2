"""The service gives back the RAM of an original it forgets: nothing it keeps for later questions (finished
requests, kept for `wait` and `status` up to max_jobs) may pin the bytes. Found by the reliability stage's long
fuzz: finished load records held their originals, ~0.9 KiB of RSS per request there, and 4096 records of real
multi-MiB segments would have pinned gigabytes the store's accounting called free."""
from __future__ import annotations

from pathlib import Path

from kmesh.harness.service import Harness
from kmesh.service import descriptor

LAYOUT = descriptor.example(num_blocks=4096)
N = descriptor.nbytes(LAYOUT)
KEY = b"shared/big-0"


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))


def test_a_forgotten_original_gives_its_ram_back_after_loads(tmp_path):
    assert N >= 32 << 20, N
    with Harness(store_bytes=4 * N, heartbeat_timeout_s=30.0) as h:
        saver, sref = h.worker_with_original(None, KEY, LAYOUT, N, seed=5, name="saver")
        loader = h.worker(name="loader")
        loader.call("alloc", name="kv", nbytes=N)
        ref = loader.call("register", name="kv", alloc_id=1, generation=1, layout=LAYOUT)
        req = loader.call("load", reg=ref["reg"], key=KEY, offset=0)
        h.accepted(N)
        h.finish()
        assert loader.call("wait", req=req)["state"] == "done"
        for w, r in ((saver, sref), (loader, ref)):
            w.call("close", reg=r["reg"])
            h.wait_released(r["reg"], timeout=30.0)
        held = _rss_kib(h.service.pid)
        assert h.admin.evict(KEY, force=True)["evicted"] == 1
        st = h.status()
        assert st["store"]["used_bytes"] == 0 and len(st["requests_running"]) == 0
        # the finished requests are still listed (for wait/status) ...
        assert h.admin.summary("all")["counts"]["requests"] >= 2
        # ... and the original's RAM is gone from the process, not only from the store's accounting
        freed = held - _rss_kib(h.service.pid)
        assert freed >= (N >> 10) * 3 // 4, f"RSS fell by {freed} KiB after forgetting a {N >> 10} KiB original"
