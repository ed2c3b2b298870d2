"""The group stage's load path: every member's segments from the service's shared originals, checked as a group
before any restored input reaches the model.

    with GroupLoad(svc, catalog, names) as load:   # one registered staging buffer per member (memfd / CUDA IPC)
        load.load_all()                             # members × segments loads (16 placements for 4 × 4)
        report = load.admit()                       # handles, layouts, generations, digests of EVERY member
        load.copy_private(engine, privates)         # each member's private copy, drained
    # stagings closed and released here: the group holds no service handle while it computes

`admit()` is the group's barrier: it raises GroupAdmissionError unless, as the service itself lists them,
every member's registration is active, mapped, of the expected handle kind and size, at the generation the
member registered, with no copy in flight; the layout digest the service computed at registration equals
the catalog layout's digest (the service refuses a load under another layout, so every accepted load used
it); every original's committed sha256 in the store equals the leader's catalog; and every staged segment
hashes to it on our side too (kmesh.kv.load.stage_segments). Only then are private copies made.
"""
from __future__ import annotations

import contextlib
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from kmesh.errors import KMeshError
from kmesh.harness.service_side import ServiceSide, Staging
from kmesh.kv.catalog import Catalog
from kmesh.kv.load import copy_private, stage_segments
from kmesh.kv.sources import ServiceSegments
from kmesh.service import descriptor
from kmesh.service.errors import RegistrationClosedError
from kmesh.transfer.engine import TransferEngine


class GroupAdmissionError(KMeshError):
    """A group member failed the check before release: no member's restored inputs reach the model."""


@contextlib.contextmanager
def _staging(svc: ServiceSide, name: str) -> Iterator[Staging]:
    """A member's staging (ServiceSide.staging); one whose registration is already released (closed from
    elsewhere, e.g. a member dropped before admission) has nothing left to close: its buffer is still unmapped."""
    try:
        with svc.staging(name) as staging:
            yield staging
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
        for name in self.names:
            self.stagings[name] = self._stack.enter_context(_staging(self.svc, f"group-{name}"))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def load_all(self) -> None:
        """Every catalog segment into every member's staging (size + digest checked per segment)."""
        for name in self.names:
            staging = self.stagings[name]
            source = ServiceSegments(self.svc.client, staging.reg, self.svc.after_accept)
            stage_segments(source, staging.tensor, self.catalog)
            self.loads += len(source.requests)

    def admit(self) -> dict[str, Any]:
        """The group barrier (module doc); returns what was checked, raises GroupAdmissionError otherwise."""
        status = self.svc.h.status()
        regs = {listed["reg"]: listed for listed in status["registrations"]}
        want_layout = descriptor.digest(self.catalog.layout.to_dict())
        kind = "cuda_ipc" if self.svc.device.type == "cuda" else "memfd"
        problems: list[str] = []
        members: dict[str, Any] = {}
        for name in self.names:
            ref = self.stagings[name].reg
            listed = regs.get(ref.reg)
            seen = None if listed is None else {k: listed[k] for k in ("state", "gen", "kind", "nbytes", "mapped",
                                                                       "in_flight_count")}
            members[name] = {"reg": ref.reg, "service": seen}
            if listed is None:
                problems.append(f"{name}: registration {ref.reg} not listed by the service")
                continue
            expect = {"state": "active", "gen": ref.gen, "kind": kind, "nbytes": self.catalog.nbytes, "mapped": True,
                      "in_flight_count": 0}
            problems += [f"{name}: {k} {seen[k]!r}, expected {v!r}" for k, v in expect.items() if seen[k] != v]
            if ref.layout_digest != want_layout:
                problems.append(f"{name}: registered layout digest differs from the catalog layout's")
        objects = {obj["key"]: obj for obj in status["store"]["objects"]}
        digests = {}
        for entry in self.catalog.entries:
            obj = objects.get(entry.key)
            digests[entry.key.decode(errors="replace")] = None if obj is None else obj["sha256"][:16]
            if obj is None or obj["state"] != "committed" or obj["sha256"] != entry.sha256 \
                    or obj["nbytes"] != entry.nbytes:
                problems.append(f"original {entry.key!r}: {obj and {k: obj[k] for k in ('state', 'nbytes', 'sha256')}} "
                                f"differs from the catalog ({entry.nbytes} B, {entry.sha256[:16]}…)")
        expected_loads = len(self.names) * len(self.catalog.entries)
        if self.loads != expected_loads:
            problems.append(f"{self.loads} loads accepted, expected {expected_loads}")
        if problems:
            raise GroupAdmissionError("group not admitted: " + "; ".join(problems))
        return {"members": members, "originals": digests, "loads": self.loads, "layout_digest_equal": True}

    def copy_private(self, engine: TransferEngine, privates: dict[str, torch.Tensor]) -> None:
        """Each member's private copy of its staged segments, drained before returning."""
        for name in self.names:
            copy_private(engine, self.stagings[name].tensor, privates[name], f"group-{name}")
