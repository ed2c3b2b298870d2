"""The storage stage's correctness controls: what a route delivers is exactly the objects' bytes (arrival), and a
bad object file is refused with its specific storage error, after which the child recomputes (failure controls).

  arrival-<arm>        poisoned landing + private buffers, objects holding the COMPLEMENT of the segment bytes:
                       what arrives is exactly those bytes, read by the route under test (bytes counted); an arm
                       that could not be built here is a skip with the reason it is missing
  control-<bad file>   wrong magic / version, short file, digest mismatch, lying header, replaced while open,
                       missing: the specific storage error, the child recomputes (run_child) = full reference
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any, Callable

import torch

from kmesh.harness.child import full_reference, run_child
from kmesh.result import Result
from kmesh.stages.storage.child import release_checked, route_restore
from kmesh.stages.storage.objects import StorageSegments, save_objects
from kmesh.stages.storage.setup import Setup
from kmesh.storage import objfile, routes


def unavailable_arrival_cases(res: Result, missing: dict[str, str]) -> None:
    """The arrival check of an arm that could not run is a skip with exactly the reason the arm is missing
    (allowed only where the profile's allow_skips names it)."""
    for name, why in missing.items():
        with res.case(f"arrival-{name}", {"route": name}) as case:
            case.skip(why)


def arrival_case(res: Result, setup: Setup, route: routes.Route) -> bool:
    with res.case(f"arrival-{route.arm}", {"poison": [0xA5, 0x5A], "objects": "complemented segment bytes"}) as case:
        comp = save_objects(setup.export, setup.root / "arrival", setup.sec["algorithm"], setup.sec.get("pad_to"),
                            transform=lambda t: t ^ 0xFF)
        landing = route.landing(comp.total_padded)
        private = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
        landing.fill_(0xA5)
        private.fill_(0x5A)
        routes.drop_page_cache(comp.paths)
        before = route.bytes_read
        owner = f"arrival-{route.arm}"
        route_restore(setup.ctx, setup.workload.children[0], comp, route, landing, private, None, owner)
        release_checked(setup.ctx, owner, landing, private)
        want = (setup.export.raw ^ 0xFF).to(setup.device)
        case.check("private_holds_complemented_bytes", bool(torch.equal(private, want)))
        case.check("not_the_export_bytes", not bool(torch.equal(private, setup.export.raw.to(setup.device))))
        case.check("route_read_every_padded_byte", route.bytes_read - before == comp.total_padded,
                   value={"read": route.bytes_read - before, "padded": comp.total_padded})
        pads = [landing[slot + header.payload_nbytes:slot + header.padded_nbytes]
                for slot, header in zip(comp.slots, comp.headers)]
        case.check("landing_padding_arrived_zero", all(not bool(p.any()) for p in pads))
        shutil.rmtree(setup.root / "arrival", ignore_errors=True)
    return res.cases[-1].passed is True


def _raw_edit(edit: Callable[[bytearray], None]) -> Callable[[Path], None]:
    def apply(path: Path) -> None:
        data = bytearray(path.read_bytes())
        edit(data)
        path.write_bytes(bytes(data))
    return apply


def _flip_at(offset: int) -> Callable[[bytearray], None]:
    def flip(data: bytearray) -> None:
        data[offset] ^= 0x01
    return flip


def _lie(path: Path) -> None:
    """A consistent header (valid own checksum) that understates the payload."""
    data = bytearray(path.read_bytes())
    _, version, body_len, _ = struct.unpack_from("<8sII32s", data)
    fields = json.loads(data[48:48 + body_len])
    fields["padded_nbytes"] -= objfile.ALIGN
    body = json.dumps(fields, sort_keys=True).encode()
    head = struct.pack("<8sII32s", objfile.MAGIC, version, len(body), hashlib.sha256(body).digest()) + body
    data[:objfile.HEADER_BYTES] = head.ljust(objfile.HEADER_BYTES, b"\0")
    path.write_bytes(bytes(data))


def bad_files() -> dict[str, tuple[Callable[[Path], None] | None, str]]:
    """name -> (mutate(path), expected storage error name); object 1 of a copy is damaged. None: replaced while
    open (done by the read itself, see control_cases)."""
    return {
        "wrong-magic": (_raw_edit(_flip_at(0)), "BadMagicError"),
        "wrong-version": (_raw_edit(lambda data: struct.pack_into("<I", data, 8, objfile.VERSION + 1)),
                          "BadVersionError"),
        "short-file": (lambda path: os.truncate(path, os.path.getsize(path) - objfile.ALIGN), "ShortFileError"),
        "digest-mismatch": (_raw_edit(_flip_at(objfile.HEADER_BYTES + 1000)), "ObjectCorruptError"),
        "lying-header": (_lie, "HeaderLieError"),
        "replaced-while-open": (None, "ObjectReplacedError"),
        "missing": (lambda path: path.unlink(), "ObjectNotFoundError"),
    }


def control_cases(res: Result, setup: Setup, route: routes.Route) -> int:
    child = setup.workload.children[0]
    full = full_reference(setup.ctx, child)
    staging = torch.empty(setup.export.catalog.nbytes, dtype=torch.uint8, device=setup.device)
    private = torch.empty_like(staging)
    passed = 0
    for name, (mutate, err) in bad_files().items():
        with res.case(f"control-{name}", {"object": 1, "route": route.arm, "expect": err}) as case:
            directory = setup.root / f"control-{name}"
            shutil.rmtree(directory, ignore_errors=True)
            bad = save_objects(setup.export, directory, setup.sec["algorithm"], setup.sec.get("pad_to"))
            after_read = None
            if mutate is not None:
                mutate(bad.paths[1])
            else:   # another object renamed over the path after it was opened and read
                def after_read(index: int, _file: Any) -> None:
                    if index == 1:
                        objfile.write_object(bad.paths[1], b"\0" * 8192, bad.headers[1].key)
            out = run_child(setup.ctx, child, StorageSegments(bad, route, after_read), staging, private)
            case.record("outcome", out.describe())
            case.check("fell_back", out.fallback is not None, value=out.fallback)
            case.check("specific_error", err in (out.fallback or ""), value=out.fallback)
            case.check("recomputed_equals_full_reference", out.tokens == full.tokens and
                       bool(torch.equal(out.logits, full.logits)), value=out.tokens)
            case.check("nothing_pending", not setup.ctx.engine.pending(f"child-{child.name}"))
            shutil.rmtree(directory, ignore_errors=True)
        passed += res.cases[-1].passed is True
    return passed
