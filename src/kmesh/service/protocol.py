"""Wire protocol v1 of the cache service: frames, message schema, validation, bounded replies.

Frame   = header (12 bytes, big endian: magic b"KMSV", u16 version, u16 nfds, u32 payload length) + payload.
Payload = one msgpack map with string keys. File descriptors (memfd handles) travel as SCM_RIGHTS attached
          to the frame's first byte; `nfds` says how many belong to the frame.
Request = {"op": str, "seq": u32, "token": bin[32] (every op but ping/hello), <op fields>}
Hello   = {"op": "hello", "instance": u31 | omitted (anonymous), "name": str, "takeover": bool, "admin": bin[32]}
          A claim on the instance of a live client is refused (instance_in_use) unless that client turns out to
          be lost at hello time (its process has exited, or its heartbeat is overdue) or the claim is an admin
          takeover (takeover=true with the admin token); the old client's registrations then close and drain,
          and the newcomer is a new client (new id, new token) that never inherits them.
          admin ops (shutdown, evict, retain, unretain, status scope="all", list scope="all" or what="objects",
          hello takeover) carry "admin": bin[32], the token in the runtime dir's 0600 admin file; it is optional
          in the schema, so a request without it is refused by the service as not_authorized (a typed error),
          not as malformed.
LoadMany= {"op": "load_many", "reg", "gen", "layout_digest", "items": [{"key": bin, "offset": u}] (1..MAX_BATCH),
           "timeout_s": f} -> {"reqs": [req...], "stopped_at": i | nil, "error": {"code", "message"} | nil,
           "jobs": [{"req", "state", "nbytes", "error"}...]}
          The items are loaded in order, each exactly as `load` would (same checks, same copy); the batch stops at
          the first item `load` would refuse (its error, typed as load's, in "error"; nothing after it is
          requested) or would park (an original not in this host's RAM: "error" nil; the client loads it and the
          rest one by one). With timeout_s > 0 the reply waits until every accepted copy is terminal (or the
          timeout): one round trip for the whole batch; "jobs" describes them (what `wait` says, without the key).
Reply   = {"seq": u32 | nil, "ok": true, "result": map}  or
          {"seq": u32 | nil, "ok": false, "error": {"code": str, "message": str}, "fatal": bool}

Every reply fits in one frame BY DESIGN: `status` is a summary of counts, states, counters and health (no
list that grows with the registry or the store), and everything that is a list comes from `list`:
    {"op": "list", "what": clients|registrations|released|requests|objects, "after": cursor | nil,
     "limit": n, "order": "asc"|"desc", "running": bool (requests only), "verify": bool (objects only)}
    -> {"items": [...], "next": cursor | nil}
A page holds at most `limit` items and is cut at PAGE_BUDGET packed bytes (one item is at most ITEM_MAX, texts
in items are clipped to TEXT_MAX), well under MAX_PAYLOAD. `next` is nil on the last page; otherwise pass it
as `after` (cursors are opaque integers in list order). Ordinary clients list only their own registrations,
released records and requests (and their own client record); all clients' items and the store's objects need
the admin token. A reply that would still not fit (a bug) becomes a non-fatal reply_too_large error.

Every field of every op is declared below (OPS) with its type and range; unknown fields are refused.
Nothing here touches the registry: parse_request() either returns a Request or raises a ServiceError.
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

from kmesh.service import descriptor
from kmesh.service.errors import DecodeError, FrameError, FrameTooLargeError, SchemaError, ServiceError, UnknownOpError

MAGIC = b"KMSV"
VERSION = 1
HEADER = struct.Struct(">4sHHI")
MAX_PAYLOAD = 64 * 1024
MAX_FDS = 4
TOKEN_BYTES = 32
KEY_MAX = 256
MAX_BATCH = 128           # loads of one load_many request (a 16k-token RAG child has 60 segments)
U32 = (1 << 32) - 1
U63 = (1 << 63) - 1
U64 = (1 << 64) - 1
MAX_MEMORY = 1 << 46
PAGE_BUDGET = 32 * 1024   # packed bytes of the items of one list page
ITEM_MAX = 8 * 1024       # packed bytes of one listed item at its worst (tests/test_service_replies.py)
TEXT_MAX = 200            # characters of a reason / error text inside a listed item
LIST_WHAT = ("clients", "registrations", "released", "requests", "objects")


# -- field types ------------------------------------------------------------------------------------
class Int:
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def check(self, name: str, v: Any) -> int:
        if not isinstance(v, int) or isinstance(v, bool):
            raise SchemaError(f"field {name!r}: expected an integer, got {type(v).__name__}")
        if not self.lo <= v <= self.hi:
            raise SchemaError(f"field {name!r}: {v} outside [{self.lo}, {self.hi}]")
        return v


class Float:
    def __init__(self, lo: float, hi: float) -> None:
        self.lo, self.hi = lo, hi

    def check(self, name: str, v: Any) -> float:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
            raise SchemaError(f"field {name!r}: expected a finite number, got {v!r}")
        if not self.lo <= v <= self.hi:
            raise SchemaError(f"field {name!r}: {v} outside [{self.lo}, {self.hi}]")
        return float(v)


class Bin:
    def __init__(self, lo: int, hi: int) -> None:
        self.lo, self.hi = lo, hi

    def check(self, name: str, v: Any) -> bytes:
        if not isinstance(v, bytes):
            raise SchemaError(f"field {name!r}: expected bytes (msgpack bin), got {type(v).__name__}")
        if not self.lo <= len(v) <= self.hi:
            raise SchemaError(f"field {name!r}: {len(v)} bytes, expected {self.lo}..{self.hi}")
        return v


class Text:
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len

    def check(self, name: str, v: Any) -> str:
        if not isinstance(v, str) or len(v) > self.max_len:
            raise SchemaError(f"field {name!r}: expected a string of at most {self.max_len} characters")
        return v


class OneOf:
    def __init__(self, *choices: str) -> None:
        self.choices = choices

    def check(self, name: str, v: Any) -> str:
        if v not in self.choices or not isinstance(v, str):
            raise SchemaError(f"field {name!r}: {v!r} not one of {list(self.choices)}")
        return v


class Flag:
    def check(self, name: str, v: Any) -> bool:
        if not isinstance(v, bool):
            raise SchemaError(f"field {name!r}: expected a boolean, got {type(v).__name__}")
        return v


class Layout:
    def check(self, name: str, v: Any) -> dict[str, Any]:
        return descriptor.validate(v)


class Record:
    """A nested map with its own declared fields (all required)."""

    def __init__(self, **fields: Any) -> None:
        self.fields = fields

    def check(self, name: str, v: Any) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise SchemaError(f"field {name!r}: expected a map, got {type(v).__name__}")
        extra = sorted(str(k) for k in v if k not in self.fields)
        if extra:
            raise SchemaError(f"field {name!r}: unknown field(s) {extra}")
        out = {}
        for k, spec in self.fields.items():
            if k not in v:
                raise SchemaError(f"field {name}.{k}: missing")
            out[k] = spec.check(f"{name}.{k}", v[k])
        return out


class Items:
    """A list of `lo`..`hi` entries, each checked by `item` (a Record)."""

    def __init__(self, item: Any, lo: int, hi: int) -> None:
        self.item, self.lo, self.hi = item, lo, hi

    def check(self, name: str, v: Any) -> list[Any]:
        if not isinstance(v, list) or not self.lo <= len(v) <= self.hi:
            raise SchemaError(f"field {name!r}: expected a list of {self.lo}..{self.hi} entries")
        return [self.item.check(f"{name}[{i}]", x) for i, x in enumerate(v)]


@dataclass(frozen=True)
class OpSpec:
    required: dict[str, Any]
    optional: dict[str, tuple[Any, Any]] = field(default_factory=dict)  # name -> (type, default)
    token: bool = True      # must carry the connection's token
    fds: tuple[int, int] = (0, 0)  # allowed range of attached fds (checked again per kind)


_REG = {"reg": Int(1, U63), "gen": Int(1, U63)}
_KEY = Bin(1, KEY_MAX)
_ADMIN = Bin(TOKEN_BYTES, TOKEN_BYTES)  # the admin capability (kmesh.service.identity.read_admin_token)
CUDA_HANDLE = Record(device=Int(0, 63), ipc_handle=Bin(64, 64), offset=Int(0, MAX_MEMORY),
                     alloc_nbytes=Int(1, MAX_MEMORY))

OPS: dict[str, OpSpec] = {
    "ping": OpSpec({}, token=False),
    # instance omitted = an anonymous client (collides with no one); takeover needs the admin capability
    "hello": OpSpec({}, {"instance": (Int(0, (1 << 31) - 1), None), "name": (Text(64), ""),
                         "takeover": (Flag(), False), "admin": (_ADMIN, None)}, token=False),
    "heartbeat": OpSpec({}),
    "register": OpSpec({"alloc_id": Int(0, U64), "generation": Int(1, U63), "kind": OneOf("memfd", "cuda_ipc"),
                        "nbytes": Int(1, MAX_MEMORY), "layout": Layout()},
                       {"cuda": (CUDA_HANDLE, None)}, fds=(0, 1)),
    "activate": OpSpec(dict(_REG)),
    "close": OpSpec(dict(_REG)),
    "save": OpSpec({**_REG, "layout_digest": Bin(32, 32), "key": _KEY, "offset": Int(0, MAX_MEMORY),
                    "nbytes": Int(1, MAX_MEMORY)}),
    "load": OpSpec({**_REG, "layout_digest": Bin(32, 32), "key": _KEY, "offset": Int(0, MAX_MEMORY)}),
    "wait": OpSpec({"req": Int(1, U63)}, {"timeout_s": (Float(0.0, 30.0), 0.0)}),
    # loads of several objects into one registration, in order, then (timeout_s > 0) one wait for all of them
    "load_many": OpSpec({**_REG, "layout_digest": Bin(32, 32),
                         "items": Items(Record(key=_KEY, offset=Int(0, MAX_MEMORY)), 1, MAX_BATCH)},
                        {"timeout_s": (Float(0.0, 30.0), 0.0)}),
    "cancel": OpSpec({"req": Int(1, U63)}),
    "evict": OpSpec({}, {"key": (_KEY, None), "admin": (_ADMIN, None), "tier": (OneOf("all", "ram"), "all"),
                         "force": (Flag(), False)}),
    # group retention of shared originals (admin): kept by ordinary eviction until unretained
    "retain": OpSpec({"group": Text(64), "key": _KEY}, {"admin": (_ADMIN, None)}),
    "unretain": OpSpec({"group": Text(64)}, {"admin": (_ADMIN, None)}),
    "status": OpSpec({}, {"scope": (OneOf("self", "all"), "self"), "admin": (_ADMIN, None)}),
    "list": OpSpec({"what": OneOf(*LIST_WHAT)},
                   {"scope": (OneOf("self", "all"), "self"), "after": (Int(0, U63), None),
                    "limit": (Int(1, 1024), 1024), "order": (OneOf("asc", "desc"), "asc"),
                    "running": (Flag(), False), "verify": (Flag(), False), "admin": (_ADMIN, None)}),
    "shutdown": OpSpec({}, {"admin": (_ADMIN, None)}),
}


@dataclass
class Request:
    op: str
    seq: int
    token: bytes | None
    args: dict[str, Any]
    fds: list[int]


def clip(text: str | None, n: int = TEXT_MAX) -> str | None:
    """A reason / error text as listed items carry it (bounded, so items stay under ITEM_MAX)."""
    return text if text is None or len(text) <= n else text[:n - 3] + "..."


def packed_size(obj: Any) -> int:
    return len(msgpack.packb(obj, use_bin_type=True))


def cut_page(items: Any, limit: int, budget: int = PAGE_BUDGET) -> tuple[list[Any], int | None]:
    """Take (cursor, describe) pairs in list order until `limit` items or `budget` packed bytes; returns the
    described items and the cursor to continue after (None when nothing is left). describe() runs only for
    items that make it into the page (it may be costly: verify re-hashes an original)."""
    out: list[Any] = []
    used, last = 0, None
    for cursor, describe in items:
        if len(out) >= limit:
            return out, last
        item = describe()
        size = packed_size(item)
        if out and used + size > budget:
            return out, last
        out.append(item)
        used, last = used + size, cursor
    return out, None


# -- frames -----------------------------------------------------------------------------------------
def pack_frame(body: dict[str, Any], nfds: int = 0, version: int = VERSION) -> bytes:
    payload = msgpack.packb(body, use_bin_type=True)
    if len(payload) > MAX_PAYLOAD:
        raise FrameTooLargeError(f"message of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(MAGIC, version, nfds, len(payload)) + payload


@dataclass
class Frame:
    version: int
    nfds: int
    payload: bytes
    fds: list[int]


class FrameAssembler:
    """Collects one frame at a time from a stream. `want()` never asks past the current frame's end, so fds
    received while reading a frame belong to that frame (they ride on its first byte)."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._header: tuple[int, int, int] | None = None  # version, nfds, length
        self.fds: list[int] = []

    def want(self) -> int:
        if self._header is None:
            return HEADER.size - len(self._buf)
        return self._header[2] - len(self._buf)

    @property
    def mid_frame(self) -> bool:
        return self._header is not None or bool(self._buf)

    def feed(self, data: bytes, fds: list[int]) -> Frame | None:
        """Add bytes (at most want()) and fds; return a complete frame or None. Raises FrameError kinds."""
        self.fds.extend(fds)
        self._buf += data
        if self._header is None and len(self._buf) == HEADER.size:
            magic, version, nfds, length = HEADER.unpack(bytes(self._buf))
            if magic != MAGIC:
                raise FrameError(f"bad frame magic {magic!r} (expected {MAGIC!r})")
            if length > MAX_PAYLOAD:
                raise FrameTooLargeError(f"frame declares {length} payload bytes, limit {MAX_PAYLOAD}")
            if nfds > MAX_FDS:
                raise FrameTooLargeError(f"frame declares {nfds} fds, limit {MAX_FDS}")
            self._header = (version, nfds, length)
            self._buf.clear()
        if self._header is not None and len(self._buf) == self._header[2]:
            version, nfds, _ = self._header
            frame = Frame(version, nfds, bytes(self._buf), self.fds)
            self._buf.clear()
            self._header = None
            self.fds = []
            return frame
        return None


# -- bodies ------------------------------------------------------------------------------------------
def _no_ext(code: int, data: bytes) -> Any:
    raise DecodeError(f"msgpack ext type {code} is not allowed")


def unpack_body(payload: bytes) -> dict[str, Any]:
    """One msgpack map with str keys, nothing after it; DecodeError otherwise."""
    try:
        body = msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True,
                               max_bin_len=MAX_PAYLOAD, max_str_len=MAX_PAYLOAD)
    except DecodeError:
        raise
    except Exception as e:  # msgpack raises several unrelated types (ExtraData, ValueError, StackError, ...)
        raise DecodeError(f"payload is not valid msgpack: {type(e).__name__}: {str(e)[:120]}") from None
    if not isinstance(body, dict):
        raise DecodeError(f"payload must be a msgpack map, got {type(body).__name__}")
    if not all(isinstance(k, str) for k in body):
        raise DecodeError("payload map keys must be strings")
    return body


def peek_seq(body: dict[str, Any]) -> int | None:
    """The seq to echo in a reply, if the body carries a valid one."""
    s = body.get("seq")
    return s if isinstance(s, int) and not isinstance(s, bool) and 0 <= s <= U32 else None


def parse_request(body: dict[str, Any], fds: list[int]) -> Request:
    """Validate a decoded body against OPS; SchemaError / UnknownOpError name the offending field."""
    op = body.get("op")
    if not isinstance(op, str):
        raise SchemaError(f"field 'op': expected a string, got {type(op).__name__}")
    spec = OPS.get(op)
    if spec is None:
        raise UnknownOpError(f"unknown op {op[:40]!r}; known: {sorted(OPS)}")
    seq = Int(0, U32).check("seq", body.get("seq"))
    allowed = {"op", "seq", *spec.required, *spec.optional} | ({"token"} if spec.token else set())
    extra = sorted(k for k in body if k not in allowed)
    if extra:
        raise SchemaError(f"op {op!r}: unknown field(s) {[e[:40] for e in extra]}")
    token = Bin(TOKEN_BYTES, TOKEN_BYTES).check("token", body.get("token")) if spec.token else None
    args: dict[str, Any] = {}
    for name, typ in spec.required.items():
        if name not in body:
            raise SchemaError(f"op {op!r}: field {name!r} missing")
        args[name] = typ.check(name, body[name])
    for name, (typ, default) in spec.optional.items():
        args[name] = typ.check(name, body[name]) if name in body and body[name] is not None else default
    lo, hi = spec.fds
    if not lo <= len(fds) <= hi:
        raise SchemaError(f"op {op!r}: {len(fds)} file descriptor(s) attached, expected {lo}..{hi}")
    return Request(op, seq, token, args, fds)


def ok_reply(seq: int | None, result: dict[str, Any]) -> dict[str, Any]:
    return {"seq": seq, "ok": True, "result": result}


def error_reply(seq: int | None, err: ServiceError) -> dict[str, Any]:
    return {"seq": seq, "ok": False, "error": {"code": err.code, "message": str(err)[:2000]},
            "fatal": bool(err.fatal)}
