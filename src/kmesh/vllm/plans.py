"""What the connector's scheduler side decides per request and hands the worker side (picklable plain data)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kmesh.vllm.objects import Record, parse_spans  # noqa: F401  (re-exported: the connector's spans)


@dataclass
class Item:
    """One stored payload: its key, the record vouching for it, where its tokens sit in this prompt."""

    key: bytes
    record: Record | None        # None for a save (written by the worker)
    start: int                   # first position in this prompt
    tokens: tuple[int, ...]


@dataclass
class LoadPlan:
    req_id: str
    mode: str                    # "prefix" | "interior"
    num_tokens: int              # external tokens claimed: positions [0, num_tokens) come from KMesh
    first: int                   # tokens the engine already had (local prefix cache): loads start here
    items: list[Item]
    span: tuple[int, ...] = ()   # interior: prompt[0:num_tokens], the span KMesh repairs
    block_ids: list[int] = field(default_factory=list)


@dataclass
class SavePlan:
    req_id: str
    items: list[Item]
    block_ids: list[int] = field(default_factory=list)


@dataclass
class KMeshMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


def slots_of(block_ids: Sequence[int], positions: Any, block_size: int) -> Any:
    """Engine slots of prompt positions, through the request's block table."""
    import torch

    table = torch.as_tensor(list(block_ids), dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size
