"""Fuzz the real service process over its real socket with >= 10,000 malformed messages.

Every message is invalid by construction (a seeded generator; each mutation is a definite violation), sent to
a service process while a bystander client process holds a registration and an original. Each message must
get a typed error reply (ok=false, a known code), or — for frames that cannot be trusted — an error reply
flagged fatal followed by the end of that connection. Afterwards: the service is alive, had no internal
error, leaked no fd, and its registry and store are exactly as before; the bystander was served throughout.
Among the sequence violations: admin ops (shutdown, evict, status of all) from an ordinary client of the same
uid, without or with a wrong admin token — refused as not_authorized, and the service keeps running.
"""
from __future__ import annotations

import os
import random
import socket
import struct
import tempfile
import time

import msgpack
import pytest

from kmesh.harness.service import Harness
from kmesh.harness.worker import pattern, sha
from kmesh.service import descriptor
from kmesh.service.errors import ERRORS_BY_CODE
from kmesh.service.handles import HostBuffer, send_frame
from kmesh.service.protocol import HEADER, MAGIC, MAX_FDS, MAX_PAYLOAD, OPS

SEED = 20261130
LAYOUT = descriptor.example(num_blocks=4)
N = descriptor.nbytes(LAYOUT)
COUNTS = {"schema": 5200, "payload": 2000, "sequence": 1250, "version": 300, "fds": 400, "fatal_header": 800,
          "truncated": 500}


def frame(payload: bytes, *, version: int = 1, nfds: int = 0, magic: bytes = MAGIC, length: int | None = None
          ) -> bytes:
    return HEADER.pack(magic, version, nfds, len(payload) if length is None else length) + payload


def pack(body: object) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


class Raw:
    """A bare protocol connection (no client library in the way)."""

    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(10)
        self.s.connect(path)
        self.token: bytes | None = None

    def send(self, data: bytes, fds: list[int] = ()) -> None:
        send_frame(self.s, data, list(fds))

    def reply(self) -> dict | None:
        """The next reply, or None at EOF."""
        head = self._exact(HEADER.size)
        if head is None:
            return None
        magic, _v, _n, length = HEADER.unpack(head)
        assert magic == MAGIC
        return msgpack.unpackb(self._exact(length) or b"", raw=False)

    def _exact(self, n: int) -> bytes | None:
        buf = b""
        while len(buf) < n:
            try:
                chunk = self.s.recv(n - len(buf))
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    def hello(self, instance: int) -> None:
        self.send(frame(pack({"op": "hello", "seq": 1, "instance": instance})))
        r = self.reply()
        assert r and r["ok"], r
        self.token = r["result"]["token"]

    def close(self) -> None:
        self.s.close()


# -- the generator ----------------------------------------------------------------------------------------
def bad_values(kind: str, spec: object) -> list[object]:
    common = [True, 1.5, "x", b"\x00", [1], {"a": 1}]
    if kind == "int":  # just outside the declared range, where msgpack can still carry it
        edges = [v for v in (spec.lo - 1, spec.hi + 1, -(1 << 63)) if -(1 << 63) <= v < 1 << 64
                 and not spec.lo <= v <= spec.hi]
        return [*edges, *common]
    if kind == "bin32":
        return [b"", b"\x01" * 31, b"\x01" * 33, "a" * 32, 7, None, [b"x"]]
    if kind == "key":
        return [b"", b"k" * 257, "str-key", 3, None, [b"k"]]
    if kind == "float":
        return [-1.0, 31.0, float("nan"), float("inf"), "1", True, [0.1]]
    if kind == "scope":
        return ["everything", "", 1, b"self", True]
    if kind == "kind":
        return ["cuda", "shm", "", 0, b"memfd"]
    if kind == "text":
        return ["n" * 65, 5, b"name", [1]]
    if kind == "flag":
        return [1, 0, "yes", None, [True]]
    raise AssertionError(kind)


def bad_layout(rng: random.Random) -> object:
    d = dict(LAYOUT)
    choice = rng.randrange(9)
    if choice == 0:
        del d[rng.choice(["packing", "order", "num_layers", "num_blocks", "block_size", "num_kv_heads",
                          "head_dim", "head_dim_v", "dtype"])]
    elif choice == 1:
        d["dtype"] = rng.choice(["float64", "int8", "", 3])
    elif choice == 2:
        d[rng.choice(["num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"])] = rng.choice(
            [0, -1, 1.0, True, "8", None, 1 << 41])
    elif choice == 3:
        d["order"] = rng.choice(["LBHCN", "lbhnc", "", None])
    elif choice == 4:
        d["packing"], d["num_kv_heads"] = "mla", 2
    elif choice == 5:
        d["extra"] = 1
    elif choice == 6:
        d[rng.choice(["k_scale", "v_scale"])] = rng.choice([0.0, -1.0, float("nan"), float("inf"), "1"])
    elif choice == 7:
        d["offset"] = rng.choice([1, 3, -2])  # not element-aligned, or negative
    else:
        return rng.choice([[], "layout", 5, None, {1: 2}])
    return d


# field name -> kind of bad value; templates give a valid value for every field
FIELD_KIND = {"instance": "int", "alloc_id": "int", "generation": "int", "nbytes": "int", "reg": "int", "gen": "int",
              "offset": "int", "req": "int", "layout_digest": "bin32", "key": "key", "timeout_s": "float",
              "scope": "scope", "kind": "kind", "name": "text", "verify": "flag", "admin": "bin32",
              "what": "scope", "order": "scope", "after": "int", "limit": "int", "running": "flag",
              "takeover": "flag"}


def templates(tok: bytes) -> dict[str, dict]:
    """A well-formed body per op (valid token); mutations below make each definitely invalid."""
    ref = {"reg": 1, "gen": 1}
    return {
        "ping": {},
        "hello": {"instance": 5},
        "heartbeat": {"token": tok},
        "register": {"token": tok, "alloc_id": 7, "generation": 1, "kind": "memfd", "nbytes": N, "layout": LAYOUT},
        "activate": {"token": tok, **ref},
        "close": {"token": tok, **ref},
        "save": {"token": tok, **ref, "layout_digest": b"\x00" * 32, "key": b"k", "offset": 0, "nbytes": 64},
        "load": {"token": tok, **ref, "layout_digest": b"\x00" * 32, "key": b"k", "offset": 0},
        "wait": {"token": tok, "req": 1, "timeout_s": 0.0},
        "cancel": {"token": tok, "req": 1},
        "evict": {"token": tok, "key": b"k", "admin": b"\x00" * 32},
        "status": {"token": tok, "scope": "self", "admin": b"\x00" * 32},
        "list": {"token": tok, "what": "registrations", "after": 1, "limit": 5, "order": "asc", "running": True},
        "shutdown": {"token": tok, "admin": b"\x00" * 32},
    }


def mutate(op: str, body: dict, rng: random.Random) -> dict:
    """Apply one definite violation (the list below is exactly what makes a body invalid)."""
    body = {"op": op, "seq": rng.randrange(1 << 32), **body}
    fields = [k for k in body if k not in ("op", "seq", "token")]
    options = ["unknown_field", "bad_seq", "bad_op"]
    if "token" in body:
        options += ["no_token", "bad_token_len"]
    required = [k for k in fields if k in OPS[op].required]
    if fields:
        options += ["bad_value"] * 4
    if required:
        options += ["drop_required"] * 2
    m = rng.choice(options)
    if m == "unknown_field":
        body[rng.choice(["extra", "Token", "opp", "x" * 60, "reg_id"])] = rng.choice([1, "v", b"v", None])
    elif m == "bad_seq":
        body["seq"] = rng.choice([-1, 1 << 32, "1", 1.0, None, True])
    elif m == "bad_op":
        body["op"] = rng.choice(["", "PING", "register2", "x" * 300, 3, None, b"ping", ["op"]])
    elif m == "no_token":
        del body["token"]
    elif m == "bad_token_len":
        body["token"] = rng.choice([b"", b"t" * 31, b"t" * 33, "t" * 32, 12])
    elif m == "drop_required":
        del body[rng.choice(required)]
    else:
        k = rng.choice(fields)
        # an optional field set to nil means "use the default", which is valid: never pick nil there
        if k == "layout":
            body[k] = bad_layout(rng)
        else:
            spec = OPS[op].required.get(k) or OPS[op].optional[k][0]
            bad = [v for v in bad_values(FIELD_KIND[k], spec) if v is not None or k in OPS[op].required]
            body[k] = rng.choice(bad)
    return body


def garbage_payload(rng: random.Random) -> bytes:
    kind = rng.randrange(8)
    if kind == 0:
        return rng.randbytes(rng.randrange(0, 200))
    if kind == 1:
        good = pack({"op": "heartbeat", "seq": 1, "token": b"t" * 32})
        return good[: rng.randrange(0, len(good))]  # msgpack cut short
    if kind == 2:
        return pack(rng.choice([[1, 2], 3, "op", b"bin", None, 1.5, True]))  # not a map
    if kind == 3:
        return pack({1: "op", 2: 3})  # non-string keys
    if kind == 4:
        return pack({"op": "ping", "seq": 1}) + rng.randbytes(rng.randrange(1, 20))  # trailing bytes
    if kind == 5:
        return msgpack.packb(msgpack.ExtType(rng.randrange(0, 127), b"ext"))
    if kind == 6:
        depth = rng.randrange(600, 3000)
        return b"\x91" * depth + b"\x01"  # deeply nested arrays
    return b"\xdb" + struct.pack(">I", 1 << 30) + b"abc"  # str32 claiming 1 GiB


# -- the test ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def svc():
    with Harness(heartbeat_timeout_s=30.0) as h:
        yield h


def _bystander(h: Harness):
    """A real client process with a registration and an original: what the fuzz must not disturb."""
    return h.worker_with_original(1, b"bystander", LAYOUT, N, seed=5)


def _serve_check(h: Harness, w, ref) -> None:
    w.call("fill", name="kv", seed=6, n=N)
    req = w.call("load", reg=ref["reg"], key=b"bystander", offset=0)
    h.accepted(N)
    h.finish()
    assert w.call("wait", req=req)["state"] == "done"
    assert w.call("digest", name="kv") == sha(pattern(5, N))


def _registry_view(st: dict) -> dict:
    return {"regs": [{k: r[k] for k in ("reg", "client", "alloc_id", "gen", "state", "in_flight", "mapped")}
                     for r in st["registrations"]],
            "clients": sorted((c["client"], c["live"], tuple(c["regs"])) for c in st["clients"]),
            "objects": [(o["key"], o["nbytes"], o["state"], o["pins"], o["sha256"]) for o in st["store"]["objects"]],
            "store_bytes": st["store"]["used_bytes"]}


def test_fuzz_10000_malformed_messages(svc: Harness) -> None:
    h = svc
    rng = random.Random(SEED)
    w, ref = _bystander(h)
    path = str(h.socket_path)
    before = _registry_view(h.status())
    fd_before = h.status()["open_fds"]
    sent = {k: 0 for k in COUNTS}
    codes: dict[str, int] = {}

    def expect_error(r: dict | None, fatal: bool | None = False) -> None:
        assert r is not None, "connection closed without an error reply"
        assert r["ok"] is False, r
        assert r["error"]["code"] in ERRORS_BY_CODE, r
        assert r["error"]["code"] != "internal", r
        if fatal is not None:
            assert r["fatal"] is fatal, r
        codes[r["error"]["code"]] = codes.get(r["error"]["code"], 0) + 1

    # 1. schema violations on a greeted connection (valid token where the op takes one)
    conn = Raw(path)
    conn.hello(instance=900)
    tmpl = templates(conn.token)
    for i in range(COUNTS["schema"]):
        op = rng.choice(list(tmpl))
        conn.send(frame(pack(mutate(op, tmpl[op], rng))))
        expect_error(conn.reply())
        sent["schema"] += 1
        if i % 1000 == 999:
            _serve_check(h, w, ref)  # the bystander keeps being served

    # 2. payloads that are not one msgpack map
    for _ in range(COUNTS["payload"]):
        conn.send(frame(garbage_payload(rng)))
        r = conn.reply()
        expect_error(r)
        assert r["error"]["code"] == "decode", r
        sent["payload"] += 1

    # 3. out of order: work before hello, a second hello, other clients' registrations and requests, admin ops
    #    without the admin capability
    fresh = Raw(path)
    for i in range(COUNTS["sequence"]):
        k = i % 5
        if k == 0:
            body = {"op": rng.choice(["heartbeat", "status", "close", "wait"]), "seq": i, "token": b"t" * 32}
            body.update({"close": {"reg": 1, "gen": 1}, "wait": {"req": 1}}.get(body["op"], {}))
            fresh.send(frame(pack(body)))
            r = fresh.reply()
            expect_error(r)
            assert r["error"]["code"] == "sequence", r
        elif k == 1:
            conn.send(frame(pack({"op": "hello", "seq": i, "instance": 901})))
            r = conn.reply()
            expect_error(r)
            assert r["error"]["code"] == "sequence", r
        elif k == 2:  # the bystander's registration, named by another client
            op = rng.choice(["activate", "close", "load", "save"])
            body = {"op": op, "seq": i, **tmpl[op], "reg": ref["reg"], "gen": ref["gen"]}
            conn.send(frame(pack(body)))
            r = conn.reply()
            expect_error(r)
            assert r["error"]["code"] == "not_owner", r
        elif k == 3:  # registrations / requests that never existed
            op = rng.choice(["activate", "close", "wait", "cancel"])
            body = {"op": op, "seq": i, **tmpl[op]}
            body.update({"reg": 10 ** 9 + i} if "reg" in body else {"req": 10 ** 9 + i})
            conn.send(frame(pack(body)))
            r = conn.reply()
            expect_error(r)
            assert r["error"]["code"] in ("unknown_registration", "unknown_request"), r
        else:  # admin ops by an ordinary client of our own uid: no admin token, or a wrong one
            op = rng.choice(["shutdown", "evict", "status"])
            body = {"op": op, "seq": i, "token": conn.token, **({"scope": "all"} if op == "status" else {})}
            if rng.random() < 0.5:
                body["admin"] = rng.choice([conn.token, rng.randbytes(32), b"\x00" * 32])
            conn.send(frame(pack(body)))
            r = conn.reply()
            expect_error(r)
            assert r["error"]["code"] == "not_authorized", r
        sent["sequence"] += 1
    fresh.close()

    # 4. other protocol versions (payload skipped, connection kept)
    for _ in range(COUNTS["version"]):
        conn.send(frame(pack({"op": "ping", "seq": 1}), version=rng.choice([0, 2, 3, 255, 65535])))
        r = conn.reply()
        expect_error(r)
        assert r["error"]["code"] == "version", r
        sent["version"] += 1

    # 5. file descriptors that do not match the frame, or are not sealed memfds
    reg_body = {"op": "register", "seq": 1, **tmpl["register"]}
    for i in range(COUNTS["fds"]):
        k = i % 5
        tmp: list[int] = []
        if k == 0:  # declares one, sends none
            conn.send(frame(pack(reg_body), nfds=1))
        elif k == 1:  # sends one, declares none
            r_, w_ = os.pipe()
            tmp = [r_, w_]
            conn.send(frame(pack(reg_body), nfds=0), fds=[r_])
        elif k == 2:  # a pipe is not memory
            r_, w_ = os.pipe()
            tmp = [r_, w_]
            conn.send(frame(pack(reg_body), nfds=1), fds=[r_])
        elif k == 3:  # an unsealed memfd could be truncated under the service
            fd = os.memfd_create("unsealed")
            os.ftruncate(fd, N)
            tmp = [fd]
            conn.send(frame(pack(reg_body), nfds=1), fds=[fd])
        else:  # a sealed memfd that is too small for the layout
            small = HostBuffer(N // 2)
            tmp = []
            conn.send(frame(pack(reg_body), nfds=1), fds=[small.fd])
            r = conn.reply()
            small.close()
            expect_error(r)
            assert r["error"]["code"] == "handle", r
            sent["fds"] += 1
            continue
        r = conn.reply()
        for fd in tmp:
            os.close(fd)
        expect_error(r)
        assert r["error"]["code"] in ("handle", "schema"), r
        sent["fds"] += 1
    _serve_check(h, w, ref)
    conn.close()

    # 6. headers that cannot be trusted: error reply flagged fatal, then the connection ends
    for i in range(COUNTS["fatal_header"]):
        c = Raw(path)
        k = i % 4
        if k == 0:
            c.send(frame(b"", magic=rng.choice([b"KMSW", b"\x00\x00\x00\x00", b"GET ", b"kmsv"])))
        elif k == 1:
            c.send(HEADER.pack(MAGIC, 1, 0, rng.randrange(MAX_PAYLOAD + 1, 1 << 32)))
        elif k == 2:
            c.send(HEADER.pack(MAGIC, 1, rng.randrange(MAX_FDS + 1, 1 << 16), 2) + b"\x80\x80")
        else:  # more fds than a frame may carry: the kernel truncates, the service refuses
            fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(MAX_FDS + 3)]
            c.send(frame(pack({"op": "ping", "seq": 1}), nfds=len(fds)), fds=fds)
            for fd in fds:
                os.close(fd)
        r = c.reply()
        expect_error(r, fatal=True)
        assert c.reply() is None, "connection kept after a fatal frame"
        c.close()
        sent["fatal_header"] += 1

    # 7. truncated frames: the peer stops mid-frame
    for i in range(COUNTS["truncated"]):
        c = Raw(path)
        data = frame(pack({"op": "ping", "seq": i, "pad": "x" * rng.randrange(0, 300)}))
        cut = rng.randrange(1, len(data))
        c.send(data[:cut])
        c.s.shutdown(socket.SHUT_WR)
        r = c.reply()
        expect_error(r, fatal=True)
        assert r["error"]["code"] == "truncated", r
        assert c.reply() is None
        c.close()
        sent["truncated"] += 1

    total = sum(sent.values())
    assert total >= 10_000, sent
    _serve_check(h, w, ref)
    time.sleep(0.05)
    st = h.wait_until("fuzz connections to close", lambda s: len(s["clients"]) == len(before["clients"]))
    assert h.service.alive()
    assert st["stats"]["internal_errors"] == 0
    assert st["violations"] == []
    assert _registry_view(st) == before, "the registry or store changed"
    assert st["open_fds"] == fd_before, "the service leaked file descriptors"
    assert st["stats"]["stale_uses"] == 0
    print(f"fuzz: {total} malformed messages {sent}; reply codes {codes}")
    w.call("close", reg=ref["reg"])
    w.exit()


def test_fuzz_peer_of_other_uid_refused_before_anything() -> None:
    """A connection from a uid the service does not serve is refused at accept (needs root to try)."""
    if os.getuid() != 0:
        pytest.skip("needs root to connect as another uid")
    from kmesh.service import process
    from kmesh.stages.ownership import _as_uid

    parent = tempfile.mkdtemp(prefix="kmesh-open-")
    os.chmod(parent, 0o711)
    sp = process.start(__import__("pathlib").Path(parent) / "rt", socket_mode=0o666)
    try:
        assert _as_uid(65534, sp.socket_path) == "auth"
    finally:
        sp.stop()
