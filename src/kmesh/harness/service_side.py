"""A model process as one client of a real cache service (the equivalence, storage and group stages share it).

The leader's export buffer is registered (memfd on CPU, CUDA IPC on GPU), each segment saved as one
immutable original, and the registration closed: the originals live on in the service's store, owned by
it. Each child registers its own staging buffer, loads into it, and closes it once its loads drained.
Copies are paced by the harness's gate; `after_accept` lets every accepted copy run (controls pass their own).
`unpace()` opens the gate for good: every later copy runs as soon as the service accepts it, as in a service
started without the harness (the TTFT's end-to-end arm: pacing is a test control, not part of a child's path).
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from kmesh.harness.leader import Export
from kmesh.harness.service import Harness
from kmesh.kv.catalog import CatalogEntry
from kmesh.service.client import RegRef, ServiceClient
from kmesh.service.handles import HostBuffer


@dataclass
class Staging:
    reg: RegRef
    tensor: torch.Tensor
    host: HostBuffer | None = None   # the memfd behind `tensor` on CPU (None on GPU: our own device allocation)


class ServiceSide:
    def __init__(self, h: Harness, export: Export, device: torch.device) -> None:
        self.h, self.export, self.device = h, export, device
        self.client = ServiceClient.connect(h.socket_path, name="kmesh-equivalence")
        self._gen = itertools.count(1)
        self._buffers: list[HostBuffer] = []
        self.paced = True

    # -- memory ----------------------------------------------------------------------------------------
    def _register(self, nbytes: int, layout: dict[str, Any],
                  name: str = "kmesh-eq") -> tuple[RegRef, torch.Tensor, Callable[[], None], HostBuffer | None]:
        """A fresh registered buffer of nbytes: (ref, tensor view, free, its memfd on CPU)."""
        if self.device.type == "cuda":
            t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            ref = self.client.register_cuda(t, alloc_id=t.data_ptr(), generation=next(self._gen), layout=layout)
            return ref, t, lambda: None, None
        buf = HostBuffer(nbytes, name=name)   # the memfd's name shows in /proc/<pid>/fd of both processes
        ref = self.client.register_host(buf, alloc_id=buf.address, generation=next(self._gen), layout=layout)
        return ref, buf.as_tensor(), buf.close, buf

    def _close(self, ref: RegRef, free: Callable[[], None]) -> None:
        self.client.close(ref)
        self.h.wait_released(ref.reg, timeout=60.0)
        free()

    @contextlib.contextmanager
    def staging(self, name: str, layout: dict[str, Any] | None = None) -> Iterator[Staging]:
        """A child's registered staging buffer; closed and released (then unmapped) on exit."""
        ref, t, free, host = self._register(self.export.catalog.nbytes,
                                            layout or self.export.catalog.layout.to_dict(), f"kmesh-eq-{name}")
        try:
            yield Staging(ref, t, host)
        finally:
            try:
                self._close(ref, free)
            except Exception:  # a dead service cannot release; our own mapping still goes
                free()
                if self.h.service.alive():
                    raise

    # -- copies ----------------------------------------------------------------------------------------
    def after_accept(self, req: int, nbytes: int) -> None:
        if not self.paced:
            return                # the gate is open for good: nothing to grant
        self.h.accepted(nbytes)
        self.h.finish()

    def unpace(self) -> None:
        """Open the harness's copy gate for good (see the module doc); saves and loads still go to the service."""
        self.h.gate.open()
        self.paced = False

    def _save(self, ref: RegRef, key: bytes, offset: int, nbytes: int) -> None:
        req = self.client.save(ref, key, offset, nbytes)
        self.after_accept(req, nbytes)
        r = self.client.wait(req, timeout=120.0)
        if r["state"] != "done":
            raise RuntimeError(f"saving {key!r} ended {r['state']}: {r.get('error')}")

    def save_leader(self, extra: list[tuple[bytes, int, int, torch.Tensor | None]] = ()) -> dict[bytes, str]:
        """Save every catalog segment (+ extra objects: (key, offset, nbytes, replacement bytes or None)) from
        a registered copy of the export buffer; returns the store's committed sha256 per key."""
        ref, t, free, _ = self._register(self.export.catalog.nbytes, self.export.catalog.layout.to_dict())
        try:
            t.copy_(self.export.raw)
            for e in self.export.catalog.entries:
                self._save(ref, e.key, e.offset, e.nbytes)
            for key, off, n, data in extra:
                if data is not None:
                    t.copy_(data)
                self._save(ref, key, off, n)
        finally:
            self._close(ref, free)
        return {k: v[0] for k, v in self.store_digests().items()}

    def save_variant(self, entry: CatalogEntry, key: bytes, nbytes: int | None = None,
                     flip_byte: int | None = None, layout: dict[str, Any] | None = None) -> None:
        """A deliberately bad object for a failure control: segment bytes, cut to nbytes, with one bit flipped,
        or saved from a registration that declares another KV geometry (`layout`)."""
        data = self.export.raw.clone()
        if flip_byte is not None:
            data[entry.offset + flip_byte] ^= 0x01
        ref, t, free, _ = self._register(self.export.catalog.nbytes, layout or self.export.catalog.layout.to_dict())
        try:
            t.copy_(data)
            self._save(ref, key, entry.offset, entry.nbytes if nbytes is None else nbytes)
        finally:
            self._close(ref, free)

    # -- observation -------------------------------------------------------------------------------------
    def store_digests(self, verify: bool = False) -> dict[bytes, tuple[str, str | None]]:
        st = self.h.status(verify=verify)
        return {o["key"]: (o["sha256"], o.get("sha256_now")) for o in st["store"]["objects"]}

    def leaks(self) -> dict[str, Any]:
        return self.h.leaks()

    def no_leaks(self) -> bool:
        return self.h.no_leaks()

    @classmethod
    @contextlib.contextmanager
    def start(cls, export: Export, device: torch.device, heartbeat_timeout_s: float,
              chunk_bytes: int) -> Iterator["ServiceSide"]:
        """A real cache service started for this process (a Harness: its store 2 GiB, copies paced in chunk_bytes)
        with this process connected as its client; both closed on exit, the client first."""
        with Harness(device=str(device), heartbeat_timeout_s=heartbeat_timeout_s, chunk_bytes=chunk_bytes,
                     store_bytes=1 << 31) as harness, cls(harness, export, device) as side:
            yield side

    def __enter__(self) -> "ServiceSide":
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(Exception):
            self.client.close_connection()
