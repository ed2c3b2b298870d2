"""The storage stage's objects on disk and a storage-backed segment source.

    objs = save_objects(export, directory, algorithm="sha256", pad_to=3 << 20)   # one object file per segment
    src = StorageSegments(objs, route)        # kmesh.kv.sources.SegmentSource: works with kmesh.harness.child.run_child

A load opens the segment's object file through the route (header checked), reads the padded payload into the
route's landing buffer, verifies the digest over the whole padded object, checks the file was not replaced while
open and that it is the catalog's object (key, size), and only then copies the payload into the staging buffer.
Every StorageError becomes the SegmentLoadError subclass run_child turns into a full recompute.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from kmesh.harness.leader import Export
from kmesh.kv.catalog import Catalog, CatalogEntry
from kmesh.kv.errors import (SegmentCorruptError, SegmentLayoutError, SegmentLoadError, SegmentMissingError,
                             SegmentTruncatedError)
from kmesh.storage import errors as se
from kmesh.storage.objfile import Header, ObjectFile, write_object
from kmesh.storage.routes import Route


@dataclass
class ObjectSet:
    catalog: Catalog
    paths: list[Path]
    headers: list[Header]
    slots: list[int]          # offset of each object's padded payload in a route's landing buffer
    total_padded: int

    def describe(self) -> dict[str, Any]:
        return {"objects": [{"path": str(p), "key": h.key.decode(errors="replace"), "payload_nbytes":
                             h.payload_nbytes, "padded_nbytes": h.padded_nbytes, "algorithm": h.algorithm,
                             "digest": h.digest.hex()} for p, h in zip(self.paths, self.headers)],
                "payload_bytes": sum(h.payload_nbytes for h in self.headers), "padded_bytes": self.total_padded}


def save_objects(export: Export, directory: Path, algorithm: str = "sha256", pad_to: int | None = None,
                 transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 params: dict[str, Any] | None = None) -> ObjectSet:
    """One object file per catalog entry (its bytes from the export buffer; `transform` alters them, e.g. the
    arrival checks' complemented bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    raw = export.raw.cpu()
    paths, headers, slots, offset = [], [], [], 0
    for entry in export.catalog.entries:
        data = raw[entry.offset:entry.offset + entry.nbytes].contiguous()
        if transform is not None:
            data = transform(data).contiguous()
        path = directory / f"segment-{entry.index}.kmo"
        header = write_object(path, data.numpy(), entry.key,
                              {"catalog_layout": export.catalog.layout.to_dict(), "offset": entry.offset,
                               "nbytes": entry.nbytes, "sha256": entry.sha256},
                              algorithm=algorithm, params=params, pad_to=pad_to)
        paths.append(path)
        headers.append(header)
        slots.append(offset)
        offset += header.padded_nbytes
    return ObjectSet(export.catalog, paths, headers, slots, offset)


def to_segment_error(error: se.StorageError) -> SegmentLoadError:
    """The SegmentLoadError a child falls back on; the message starts with the storage error's class name."""
    msg = f"{type(error).__name__}: {error}"
    if isinstance(error, se.ObjectNotFoundError):
        return SegmentMissingError(msg)
    if isinstance(error, se.ShortFileError):
        return SegmentTruncatedError(msg)
    if isinstance(error, se.ObjectMismatchError):
        return SegmentLayoutError(msg)
    if isinstance(error, (se.ObjectCorruptError, se.HeaderCorruptError, se.HeaderLieError, se.BadMagicError,
                      se.BadVersionError, se.ObjectAlgorithmError, se.ObjectReplacedError)):
        return SegmentCorruptError(msg)
    return SegmentLoadError(msg)


def read_verified(route: Route, objs: ObjectSet, index: int, landing: torch.Tensor,
                  after_read: Callable[[int, ObjectFile], None] | None = None,
                  read_part: Callable[[], Any] | None = None) -> torch.Tensor:
    """Object `index` through the route into its landing slot, verified; returns the payload view. Raises
    StorageError. `read_part()` is a context manager around the read call alone (the stage's timed `read`)."""
    with route.open(objs.paths[index]) as file:
        header = file.header
        dst = landing[objs.slots[index]:objs.slots[index] + header.padded_nbytes]
        if read_part is None:
            route.read(file, dst)
        else:
            with read_part():
                route.read(file, dst)
        if after_read is not None:
            after_read(index, file)
        header.verify(route.host_bytes(dst), str(objs.paths[index]))
        file.check_unchanged()
    check_catalog_object(objs, index, header)
    return dst[:header.payload_nbytes]


def check_catalog_object(objs: ObjectSet, index: int, header: Header) -> None:
    """The file at objs.paths[index] holds the catalog's object `index` (key and payload size), else
    ObjectMismatchError."""
    entry = objs.catalog.entries[index]
    if header.key != entry.key or header.payload_nbytes != entry.nbytes:
        raise se.ObjectMismatchError(f"{objs.paths[index]} holds {header.key!r} ({header.payload_nbytes} B), the "
                                     f"catalog wants {entry.key!r} ({entry.nbytes} B)")


class StorageSegments:
    """SegmentSource over object files: load(entry, staging) through a storage route."""

    def __init__(self, objs: ObjectSet, route: Route,
                 after_read: Callable[[int, ObjectFile], None] | None = None) -> None:
        self.objs, self.route, self.after_read = objs, route, after_read
        self.name = f"storage:{route.arm}"
        self.landing = route.landing(objs.total_padded)

    def load(self, entry: CatalogEntry, staging: torch.Tensor) -> int:
        try:
            payload = read_verified(self.route, self.objs, entry.index, self.landing, self.after_read)
        except se.StorageError as e:
            raise to_segment_error(e) from e
        nbytes = payload.numel()
        if entry.offset + nbytes > staging.numel():
            raise SegmentTruncatedError(f"object {entry.key!r} of {nbytes} B overruns the staging buffer")
        staging[entry.offset:entry.offset + nbytes].copy_(payload)
        return nbytes
