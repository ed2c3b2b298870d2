"""The layout descriptor a client registers with its memory, until kmesh.layout.KVLayout takes its place.

A descriptor is a small dict that says what the registered bytes hold: the KV cache geometry (layers, blocks,
kv-heads, tokens per block, head dim), dtype, memory order and how K and V are packed. The service uses it
for three things only, so KVLayout can replace it behind the same three functions:
  - `validate(d)`  -> the canonical dict (every field checked; unknown fields refused),
  - `nbytes(d)`    -> bytes the layout covers (the registration must map at least this much),
  - `digest(d)` / `geometry_digest(d)` -> identity of the exact layout / of its per-block geometry
    (num_blocks aside), checked against every request and against the layout an object was saved from.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

import msgpack

from kmesh.service.errors import SchemaError

DTYPE_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "uint8": 1}
ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
# kv_split_c: each [.., C] row holds K = C[:D] then V = C[D:]   (vLLM >= 0.29 GPU layout)
# cpu_kt_planes: per (block, head) a K plane N x D (stored transposed) then a V plane   (vLLM CPU backend)
# mla: one latent per token (no separate V), H must be 1
PACKINGS = ("kv_split_c", "cpu_kt_planes", "mla")
VERSION = 1
_INTS = ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim")
_LIMIT = 1 << 24  # per axis: far above any real cache, small enough that products stay exact
FIELDS = ("version", "dtype", "order", "kv_packing", *_INTS, "fp8_scale")


def validate(d: Any) -> dict[str, Any]:
    """The canonical descriptor, or SchemaError naming the first bad field."""
    if not isinstance(d, dict):
        raise SchemaError(f"layout must be a map, got {type(d).__name__}")
    unknown = sorted(str(k) for k in d if k not in FIELDS)
    if unknown:
        raise SchemaError(f"layout: unknown field(s) {unknown}; known: {list(FIELDS)}")
    for k in FIELDS[:-1]:
        if k not in d:
            raise SchemaError(f"layout.{k}: missing")
    if d["version"] != VERSION or isinstance(d["version"], bool):
        raise SchemaError(f"layout.version: {d['version']!r} is not {VERSION}")
    if d["dtype"] not in DTYPE_SIZES:
        raise SchemaError(f"layout.dtype: {d['dtype']!r} not one of {sorted(DTYPE_SIZES)}")
    if d["order"] not in ORDERS:
        raise SchemaError(f"layout.order: {d['order']!r} not one of {list(ORDERS)}")
    if d["kv_packing"] not in PACKINGS:
        raise SchemaError(f"layout.kv_packing: {d['kv_packing']!r} not one of {list(PACKINGS)}")
    for k in _INTS:
        v = d[k]
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= _LIMIT:
            raise SchemaError(f"layout.{k}: {v!r} is not an integer in [1, {_LIMIT}]")
    if d["kv_packing"] == "mla" and d["num_kv_heads"] != 1:
        raise SchemaError(f"layout.num_kv_heads: mla packing stores one latent head, got {d['num_kv_heads']}")
    fp8 = d["dtype"].startswith("float8")
    scale = d.get("fp8_scale")
    if fp8 != (scale is not None):
        raise SchemaError("layout.fp8_scale: required for fp8 dtypes, absent otherwise")
    if scale is not None and (not isinstance(scale, float) or not math.isfinite(scale) or scale <= 0):
        raise SchemaError(f"layout.fp8_scale: {scale!r} is not a positive finite float")
    out = {k: d[k] for k in FIELDS if k in d}
    if nbytes(out) > 1 << 46:
        raise SchemaError(f"layout covers {nbytes(out)} bytes, more than 64 TiB")
    return out


def itemsize(d: dict[str, Any]) -> int:
    return DTYPE_SIZES[d["dtype"]]


def nbytes(d: dict[str, Any]) -> int:
    """Bytes of the whole cache this layout describes."""
    channels = d["head_dim"] * (1 if d["kv_packing"] == "mla" else 2)
    return (d["num_layers"] * d["num_blocks"] * d["num_kv_heads"] * d["block_size"] * channels
            * DTYPE_SIZES[d["dtype"]])


def _digest(obj: dict[str, Any]) -> bytes:
    return hashlib.sha256(msgpack.packb(sorted(obj.items()))).digest()


def digest(d: dict[str, Any]) -> bytes:
    """32 bytes naming this exact layout (a request must present the digest of its registration's layout)."""
    return _digest(d)


def geometry_digest(d: dict[str, Any]) -> bytes:
    """Identity of everything but num_blocks: an object saved under one layout loads into another of the same
    geometry (a different cache size), never into a different dtype/heads/order/packing."""
    return _digest({k: v for k, v in d.items() if k != "num_blocks"})


def example(num_blocks: int = 16, dtype: str = "bfloat16", **over: Any) -> dict[str, Any]:
    """A valid descriptor (tests and stages), Qwen2.5-0.5B-like per layer geometry by default."""
    d = {"version": VERSION, "dtype": dtype, "order": "LBHNC", "kv_packing": "kv_split_c", "num_layers": 2,
         "num_blocks": num_blocks, "block_size": 16, "num_kv_heads": 2, "head_dim": 64}
    if dtype.startswith("float8"):
        d["fp8_scale"] = 1.0
    d.update(over)
    return validate(d)
