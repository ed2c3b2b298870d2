"""The layout a client registers with its memory: a kmesh.kv.layout.KVLayout, carried as its to_dict() form.

The service needs four things from a layout, all answered by KVLayout behind these functions:
  - `validate(d)`  -> the canonical dict (every field type-checked here, then KVLayout's own checks; unknown
    fields refused), so a malformed descriptor is a SchemaError reply, never a crash;
  - `nbytes(d)` / `itemsize(d)` -> bytes the layout covers (the registration must be exactly that large) and
    the element size every request offset/size must be a multiple of;
  - `digest(d)` -> identity of this exact layout, presented by every request (a client whose cache was
    re-created with another layout cannot use the old registration);
  - `geometry_digest(d)` -> identity of the per-block geometry (everything but the number of blocks and the
    strides that follow from it): an original saved under one layout loads only into the same geometry.
kmesh.kv.layout (and so torch) is imported lazily: clients build and send the dict without importing either.
"""
from __future__ import annotations

import hashlib
import math
from typing import Any

import msgpack

from kmesh.service.errors import SchemaError

_INT, _FLOAT, _STR, _OPT_INT = "int", "float", "str", "int|None"
FIELDS: dict[str, str] = {
    "packing": _STR, "order": _STR, "num_layers": _INT, "num_blocks": _INT, "block_size": _INT,
    "num_kv_heads": _INT, "head_dim": _INT, "head_dim_v": _INT, "dtype": _STR, "rope_offset": _INT,
    "k_scale": _FLOAT, "v_scale": _FLOAT, "layer_stride": _OPT_INT, "block_stride": _OPT_INT, "offset": _INT,
}
REQUIRED = ("packing", "order", "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim",
            "head_dim_v", "dtype")
# What depends on the cache's size rather than on its per-block geometry.
_SIZE_FIELDS = ("num_blocks", "layer_stride", "block_stride", "offset")
_LIMIT = 1 << 40
MAX_BYTES = 1 << 46


def _typed(name: str, kind: str, v: Any) -> None:
    if kind == _OPT_INT and v is None:
        return
    if kind in (_INT, _OPT_INT):
        ok = isinstance(v, int) and not isinstance(v, bool) and -_LIMIT <= v <= _LIMIT
    elif kind == _FLOAT:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    else:
        ok = isinstance(v, str) and len(v) <= 32
    if not ok:
        raise SchemaError(f"layout.{name}: {str(v)[:40]!r} is not a valid {kind}")


def _layout(d: dict[str, Any]) -> Any:
    from kmesh.kv.layout import KVLayout, LayoutError

    try:
        return KVLayout.from_dict(d)
    except LayoutError as e:
        raise SchemaError(f"layout: {e}") from None


def validate(d: Any) -> dict[str, Any]:
    """The canonical descriptor, or SchemaError naming the first bad field."""
    if not isinstance(d, dict):
        raise SchemaError(f"layout must be a map, got {type(d).__name__}")
    unknown = sorted(str(k)[:40] for k in d if k not in FIELDS)
    if unknown:
        raise SchemaError(f"layout: unknown field(s) {unknown}; known: {list(FIELDS)}")
    for k in REQUIRED:
        if k not in d:
            raise SchemaError(f"layout.{k}: missing")
    for k, v in d.items():
        _typed(k, FIELDS[k], v)
    lay = _layout(d)
    if lay.nbytes > MAX_BYTES:
        raise SchemaError(f"layout covers {lay.nbytes} bytes, more than {MAX_BYTES}")
    return lay.to_dict()


def nbytes(d: dict[str, Any]) -> int:
    return int(_layout(d).nbytes)


def itemsize(d: dict[str, Any]) -> int:
    return int(_layout(d).element_size)


def _digest(obj: dict[str, Any]) -> bytes:
    return hashlib.sha256(msgpack.packb(sorted(obj.items()))).digest()


def digest(d: dict[str, Any]) -> bytes:
    return _digest(d)


def geometry_digest(d: dict[str, Any]) -> bytes:
    return _digest({k: v for k, v in d.items() if k not in _SIZE_FIELDS})


def example(num_blocks: int = 16, dtype: str = "bfloat16", **over: Any) -> dict[str, Any]:
    """A paged (GPU-style [K|V]) descriptor, Qwen2.5-0.5B-like per-layer geometry, 2 layers; torch-free."""
    d = {"packing": "paged", "order": "LBHNC", "num_layers": 2, "num_blocks": num_blocks, "block_size": 16,
         "num_kv_heads": 2, "head_dim": 64, "head_dim_v": 64, "dtype": dtype, "rope_offset": 0, "k_scale": 1.0,
         "v_scale": 1.0, "layer_stride": None, "block_stride": None, "offset": 0}
    d.update(over)
    return d


def example_nbytes(d: dict[str, Any]) -> int:
    """Dense size of an `example` descriptor without importing torch (clients size their buffers with it)."""
    item = {"float32": 4, "float16": 2, "bfloat16": 2}.get(d["dtype"], 1)
    return (d["num_layers"] * d["num_blocks"] * d["num_kv_heads"] * d["block_size"]
            * (d["head_dim"] + d["head_dim_v"]) * item)
