"""What the connector's scheduler side decides per request and hands the worker side (picklable plain data), and
the request's own words about it: segment spans, and slots through its block table. No vLLM import: the
connector's loads (kmesh.vllm.loads) run without an engine too."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from kmesh.kv.record import Record


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


def slots_of(block_ids: Sequence[int], positions: Any, block_size: int) -> Any:
    """Engine slots of prompt positions, through the request's block table."""
    import torch

    table = torch.as_tensor(list(block_ids), dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size


def parse_spans(raw: Any, length: int) -> list[tuple[int, int]] | None:
    """Request-supplied segment spans [[start, end], ...]: sorted, disjoint, inside the prompt; None if malformed."""
    if not isinstance(raw, (list, tuple)):
        return None
    out: list[tuple[int, int]] = []
    for s in raw:
        if (not isinstance(s, (list, tuple)) or len(s) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in s)):
            return None
        a, b = s
        if not 0 <= a < b <= length or (out and a < out[-1][1]):
            return None
        out.append((a, b))
    return out
