"""`kmesh service start | stop | status` (wired into the main CLI by kmesh.cli)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from kmesh.service.errors import ServiceError, ServiceUnavailableError


def add_service_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("service", help="run or query the cache-service process")
    sub = p.add_subparsers(dest="service_command", required=True)

    def common(q: argparse.ArgumentParser) -> None:
        q.add_argument("--runtime-dir", type=Path, default=None,
                       help="socket + pid file (default $KMESH_RUNTIME_DIR, $XDG_RUNTIME_DIR/kmesh, /tmp/kmesh-UID)")

    s = sub.add_parser("start", help="start the service (detached unless --foreground)")
    common(s)
    s.add_argument("--device", default="cpu", help="cpu, or cuda[:N] to also accept CUDA IPC registrations")
    s.add_argument("--heartbeat-timeout", type=float, default=10.0, help="seconds of client silence before closing")
    s.add_argument("--store-bytes", type=int, default=1 << 30, help="host-RAM tier capacity")
    s.add_argument("--disk-dir", type=Path, default=None,
                   help="disk tier under the host-RAM tier: commits spill object files here; a restart re-adopts them")
    s.add_argument("--no-adopt", action="store_true",
                   help="start with an empty store although --disk-dir holds a previous run's object files")
    s.add_argument("--eviction", choices=("lru", "none"), default="lru",
                   help="a full RAM tier evicts the least recently used originals nobody holds (lru, the default: to "
                        "the disk tier, or forgotten without one) or refuses the save (none)")
    s.add_argument("--high-watermark", type=float, default=1.0, help="evict when RAM would pass this fraction")
    s.add_argument("--low-watermark", type=float, default=0.9, help="... down to this fraction")
    s.add_argument("--foreground", action="store_true", help="run in this process (logs to stderr)")
    s.set_defaults(func=_start)

    t = sub.add_parser("stop", help="shut down: registrations close and drain, then the process exits")
    common(t)
    t.add_argument("--timeout", type=float, default=60.0)
    t.add_argument("--no-force", action="store_true", help="do not SIGKILL after the timeout")
    t.set_defaults(func=_stop)

    u = sub.add_parser("status", help="clients, registrations by state, store, health")
    common(u)
    u.add_argument("--json", action="store_true")
    u.set_defaults(func=_status)


def _start(a: argparse.Namespace) -> int:
    from kmesh.service import process

    rd = a.runtime_dir or process.default_runtime_dir()
    if a.foreground:
        from kmesh.service.server import main

        disk = ["--disk-dir", str(a.disk_dir)] + (["--no-adopt"] if a.no_adopt else []) if a.disk_dir else []
        return main(["--runtime-dir", str(rd), "--device", a.device, "--heartbeat-timeout",
                     str(a.heartbeat_timeout), "--store-bytes", str(a.store_bytes), *disk, "--eviction", a.eviction,
                     "--high-watermark", str(a.high_watermark), "--low-watermark", str(a.low_watermark)])
    sp = process.start(rd, device=a.device, heartbeat_timeout_s=a.heartbeat_timeout, store_bytes=a.store_bytes,
                       detach=True, disk_dir=a.disk_dir, adopt=not a.no_adopt, eviction=a.eviction,
                       high_watermark=a.high_watermark, low_watermark=a.low_watermark)
    print(f"kmesh service pid {sp.pid} listening on {sp.socket_path} (log {sp.log_path})")
    return 0


def _stop(a: argparse.Namespace) -> int:
    from kmesh.service import process

    sp = process.find(a.runtime_dir)
    if not sp.alive():
        print(f"no kmesh service running for {sp.runtime_dir}")
        return 0
    pid = sp.pid
    sp.stop(timeout=a.timeout, force=not a.no_force)
    print(f"kmesh service pid {pid} {'stopped' if not sp.alive() else 'STILL RUNNING'}")
    return 0 if not sp.alive() else 1


def _status(a: argparse.Namespace) -> int:
    from kmesh.service import process
    from kmesh.service.client import ServiceClient

    sp = process.find(a.runtime_dir)
    try:
        with ServiceClient.connect(sp.socket_path, name="kmesh-status", heartbeat=False) as c:  # anonymous
            c.admin_token = sp.admin_token()  # status of all clients is an admin op
            # the summary is one bounded reply; --json also pages through every list
            st = c.status("all") if a.json else c.summary("all")
    except ServiceUnavailableError as e:
        print(f"kmesh service: not running ({e})")
        return 1
    except ServiceError as e:
        print(f"kmesh service: status refused: {e}")
        return 1
    if a.json:
        print(json.dumps(st, indent=1, default=lambda b: b.hex() if isinstance(b, bytes) else str(b)))
        return 0
    live = st["counts"]["clients_live"] - 1  # minus this status connection
    print(f"kmesh service pid {st['pid']} on {sp.socket_path}")
    print(f"  clients live: {live}   registrations: {st['by_state']}   copies running: {st['copies_running']}")
    print(f"  store: {st['store']['nobjects']} / {st['store']['max_objects']} originals, {st['store']['used_bytes']}"
          f" / {st['store']['capacity_bytes']} bytes, {st['store']['pins']} pins")
    if st["store"].get("disk_dir"):
        k, dr = st["store"]["counters"], st.get("disk_reads") or {}
        print(f"  disk tier {st['store']['disk_dir']}: {k['adopted']} adopted at start, {k['disk_rejected']} file(s) "
              f"rejected; {k['disk_reads']} read-backs ({k['disk_read_failures']} failed), {k['joins']} joined, "
              f"{dr.get('in_flight', 0)} in flight")
        for r in st["store"].get("disk_rejected", []):
            print(f"    rejected {r['file']}: {r['reason']}")
    print(f"  mappings: memfd {st['memfd_mappings']}, cuda ipc {st['cuda_handles_open']}; "
          f"frames {st['stats']['frames']}, errors {sum(st['stats']['errors'].values())}, "
          f"internal errors {st['stats']['internal_errors']}, stale uses {st['stats']['stale_uses']}")
    if st["violations"]:
        print(f"  INVARIANT VIOLATIONS ({st['violations_count']}): {st['violations']}")
        return 1
    return 0
