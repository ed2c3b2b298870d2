"""The group stage's load path: every member's segments from the service's shared originals, checked as a group
before any restored input reaches the model.

    with GroupLoad(svc, catalog, names) as g:      # one registered staging buffer per member (memfd / CUDA IPC)
        g.load_all()                                # members × segments loads (16 placements for 4 × 4)
        report = g.admit()                          # handles, layouts, generations, digests of EVERY member
        g.copy_private(engine, privates)            # each member's private copy, drained
    # stagings closed and released here: the group holds no service handle while it computes

`admit()` is the group's barrier: it raises GroupAdmissionError unless, as the service itself lists them,
every member's registration is active, mapped, of the expected handle kind and size, at the generation the
member registered, with no copy in flight; the layout digest the service computed at registration equals
the catalog layout's digest (the service refuses a load under another layout, so every accepted load used
it); every original's committed sha256 in the store equals the leader's catalog; and every staged segment
hashes to it on our side too (kmesh.segments.stage_segments). Only then are private copies made.
"""
from __future__ import annotations

import contextlib
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from kmesh.errors import KMeshError
from kmesh.segments import Catalog, ServiceSegments, copy_private, stage_segments
from kmesh.service import descriptor
from kmesh.service.errors import RegistrationClosedError
from kmesh.service_side import ServiceSide, Staging
from kmesh.transfer.engine import TransferEngine


class GroupAdmissionError(KMeshError):
    """A group member failed the check before release: no member's restored inputs reach the model."""


@contextlib.contextmanager
def _staging(svc: ServiceSide, name: str) -> Iterator[Staging]:
    """A member's staging (ServiceSide.staging); one whose registration is already released (closed from
    elsewhere, e.g. a member dropped before admission) has nothing left to close: its buffer is still unmapped."""
    try:
        with svc.staging(name) as st:
            yield st
    except RegistrationClosedError:
        pass


@dataclass
class GroupLoad:
    svc: ServiceSide
    catalog: Catalog
    names: Sequence[str]
    stagings: dict[str, Staging] = field(default_factory=dict)
    loads: int = 0
    _stack: ExitStack = field(default_factory=ExitStack)

    def __enter__(self) -> "GroupLoad":
        for n in self.names:
            self.stagings[n] = self._stack.enter_context(_staging(self.svc, f"group-{n}"))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def load_all(self) -> None:
        """Every catalog segment into every member's staging (size + digest checked per segment)."""
        for n in self.names:
            st = self.stagings[n]
            src = ServiceSegments(self.svc.client, st.reg, self.svc.after_accept)
            stage_segments(src, st.tensor, self.catalog)
            self.loads += len(src.requests)

    def admit(self) -> dict[str, Any]:
        """The group barrier (module doc); returns what was checked, raises GroupAdmissionError otherwise."""
        st = self.svc.h.status()
        regs = {r["reg"]: r for r in st["registrations"]}
        want_layout = descriptor.digest(self.catalog.layout.to_dict())
        kind = "cuda_ipc" if self.svc.device.type == "cuda" else "memfd"
        problems: list[str] = []
        members: dict[str, Any] = {}
        for n in self.names:
            ref = self.stagings[n].reg
            r = regs.get(ref.reg)
            seen = None if r is None else {k: r[k] for k in ("state", "gen", "kind", "nbytes", "mapped",
                                                             "in_flight_count")}
            members[n] = {"reg": ref.reg, "service": seen}
            if r is None:
                problems.append(f"{n}: registration {ref.reg} not listed by the service")
                continue
            expect = {"state": "active", "gen": ref.gen, "kind": kind, "nbytes": self.catalog.nbytes, "mapped": True,
                      "in_flight_count": 0}
            problems += [f"{n}: {k} {seen[k]!r}, expected {v!r}" for k, v in expect.items() if seen[k] != v]
            if ref.layout_digest != want_layout:
                problems.append(f"{n}: registered layout digest differs from the catalog layout's")
        objects = {o["key"]: o for o in st["store"]["objects"]}
        digests = {}
        for e in self.catalog.entries:
            o = objects.get(e.key)
            digests[e.key.decode(errors="replace")] = None if o is None else o["sha256"][:16]
            if o is None or o["state"] != "committed" or o["sha256"] != e.sha256 or o["nbytes"] != e.nbytes:
                problems.append(f"original {e.key!r}: {o and {k: o[k] for k in ('state', 'nbytes', 'sha256')}} "
                                f"differs from the catalog ({e.nbytes} B, {e.sha256[:16]}…)")
        expected_loads = len(self.names) * len(self.catalog.entries)
        if self.loads != expected_loads:
            problems.append(f"{self.loads} loads accepted, expected {expected_loads}")
        if problems:
            raise GroupAdmissionError("group not admitted: " + "; ".join(problems))
        return {"members": members, "originals": digests, "loads": self.loads, "layout_digest_equal": True}

    def copy_private(self, engine: TransferEngine, privates: dict[str, torch.Tensor]) -> None:
        """Each member's private copy of its staged segments, drained before returning."""
        for n in self.names:
            copy_private(engine, self.stagings[n].tensor, privates[n], f"group-{n}")
