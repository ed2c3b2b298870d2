"""CPU implementations of the integrity algorithms (what kmesh.integrity registers; GPU digests must equal these).

- `sha256`: hashlib over the whole object (SHA-NI; one core).
- `sha256-tree`: leaves hashed by a thread pool over contiguous leaf ranges (hashlib releases the GIL for updates of
  ≥ 2 KiB, so chunks of 2 KiB and more hash on all cores; smaller chunks are bound by the interpreter), then the
  levels (kmesh.integrity.tree.fold_levels).
- `blake3`: the `blake3` package (the BLAKE3 team's Rust implementation) with max_threads = all cores.
"""
from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kmesh.integrity import tree

_pools: dict[int, ThreadPoolExecutor] = {}


def cpu_threads() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _pool(threads: int) -> ThreadPoolExecutor:
    if threads not in _pools:
        _pools[threads] = ThreadPoolExecutor(threads, thread_name_prefix="kmesh-sha256-tree")
    return _pools[threads]


def sha256(data: Any) -> bytes:
    return hashlib.sha256(memoryview(data).cast("B")).digest()


def _leaves(mv: memoryview, chunk: int, first: int, last: int) -> list[bytes]:
    base = hashlib.sha256(tree.LEAF_PREFIX)
    out = []
    for i in range(first, last):
        h = base.copy()
        h.update(mv[i * chunk:(i + 1) * chunk])
        out.append(h.digest())
    return out


def sha256_tree(data: Any, chunk_bytes: int | None = None, threads: int | None = None) -> bytes:
    chunk = tree.check_chunk_bytes(chunk_bytes)
    mv = memoryview(data).cast("B")
    n = tree.leaf_count(len(mv), chunk)
    threads = max(1, min(threads or cpu_threads(), n))
    if threads == 1 or len(mv) < 4 * chunk:
        return tree.fold_levels(_leaves(mv, chunk, 0, n))
    step = -(-n // threads)
    parts = _pool(threads).map(lambda a: _leaves(mv, chunk, a, min(a + step, n)), range(0, n, step))
    return tree.fold_levels([d for part in parts for d in part])


def blake3(data: Any, threads: int | None = None) -> bytes:
    import blake3 as _b3

    mt = _b3.blake3.AUTO if threads is None else int(threads)
    return _b3.blake3(memoryview(data).cast("B"), max_threads=mt).digest()
