"""Unit tests of the service's parts, in this process: frames, schema, errors, layout descriptor, the
registration state machine, the store, identity and memory handles. (Cross-process behaviour is tested by
test_service_fuzz.py, test_service_cycles.py and the ownership stage.)"""
from __future__ import annotations

import os
import socket

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kmesh.service import descriptor, identity
from kmesh.service.errors import (ERRORS_BY_CODE, AuthError, DecodeError, FrameError, FrameTooLargeError, HandleError,
                                  InstanceInUseError, InternalError, NotAuthorizedError, NotOwnerError,
                                  ObjectExistsError, ObjectMissingError, RegistrationClosedError,
                                  RegistrationStateError, SchemaError, ServiceError, StaleGenerationError,
                                  UnknownOpError, UnknownRegistrationError, error_from_reply)
from kmesh.service.handles import HostBuffer, check_memfd
from kmesh.service.protocol import (HEADER, MAGIC, MAX_FDS, MAX_PAYLOAD, OPS, FrameAssembler, error_reply, pack_frame,
                                    parse_request, unpack_body)
from kmesh.service.registry import NEXT, Registry, State
from kmesh.service.store import Store

TOKEN = b"t" * 32
ADMIN = b"a" * 32
LAYOUT = descriptor.example(num_blocks=4)


def valid_bodies() -> dict[str, dict]:
    ref = {"reg": 3, "gen": 2}
    return {
        "ping": {}, "hello": {"instance": 1, "name": "w", "takeover": True, "admin": ADMIN},
        "heartbeat": {"token": TOKEN},
        "register": {"token": TOKEN, "alloc_id": 1 << 63, "generation": 1, "kind": "memfd", "nbytes": 64,
                     "layout": LAYOUT},
        "activate": {"token": TOKEN, **ref}, "close": {"token": TOKEN, **ref},
        "save": {"token": TOKEN, **ref, "layout_digest": b"d" * 32, "key": b"k", "offset": 0, "nbytes": 8},
        "load": {"token": TOKEN, **ref, "layout_digest": b"d" * 32, "key": b"k", "offset": 8},
        "load_many": {"token": TOKEN, **ref, "layout_digest": b"d" * 32, "items": [{"key": b"k", "offset": 8}],
                      "timeout_s": 1},
        "wait": {"token": TOKEN, "req": 9, "timeout_s": 1}, "cancel": {"token": TOKEN, "req": 9},
        "evict": {"token": TOKEN, "admin": ADMIN, "tier": "ram", "force": True},
        "retain": {"token": TOKEN, "group": "g", "key": b"k", "admin": ADMIN},
        "unretain": {"token": TOKEN, "group": "g", "admin": ADMIN},
        "status": {"token": TOKEN, "scope": "all", "admin": ADMIN},
        "list": {"token": TOKEN, "what": "objects", "scope": "all", "after": 7, "limit": 10, "order": "desc",
                 "verify": True, "admin": ADMIN},
        "shutdown": {"token": TOKEN, "admin": ADMIN},
    }


# -- frames ------------------------------------------------------------------------------------------------
def test_frame_reassembles_byte_by_byte_and_keeps_its_fds() -> None:
    body = {"op": "ping", "seq": 7, "x": "y" * 100}
    data = pack_frame(body, nfds=1)
    asm = FrameAssembler()
    frame = None
    for i in range(len(data)):
        assert asm.want() >= 1
        frame = asm.feed(data[i:i + 1], [42] if i == 0 else [])
        assert (frame is None) == (i < len(data) - 1)
    assert frame.nfds == 1 and frame.fds == [42] and unpack_body(frame.payload) == body
    assert not asm.mid_frame and asm.fds == []


def test_assembler_never_asks_past_the_frame() -> None:
    asm = FrameAssembler()
    data = pack_frame({"op": "ping", "seq": 1})
    assert asm.want() == HEADER.size
    asm.feed(data[:HEADER.size], [])
    assert asm.want() == len(data) - HEADER.size


@pytest.mark.parametrize("header,err", [
    (HEADER.pack(b"KMSX", 1, 0, 1), FrameError),
    (HEADER.pack(MAGIC, 1, 0, MAX_PAYLOAD + 1), FrameTooLargeError),
    (HEADER.pack(MAGIC, 1, MAX_FDS + 1, 1), FrameTooLargeError),
])
def test_untrustworthy_headers_are_fatal(header: bytes, err: type) -> None:
    with pytest.raises(err) as e:
        FrameAssembler().feed(header, [])
    assert e.value.fatal


@pytest.mark.parametrize("payload", [
    b"", b"\x93\x01\x02\x03", msgpack.packb({1: 2}), msgpack.packb({"a": 1}) + b"\x00",
    msgpack.packb(msgpack.ExtType(3, b"x")), b"\x91" * 5000 + b"\x01", b"\xc1", msgpack.packb({"a": 1})[:-1],
])
def test_payloads_that_are_not_one_map_are_decode_errors(payload: bytes) -> None:
    with pytest.raises(DecodeError):
        unpack_body(payload)


# -- schema ------------------------------------------------------------------------------------------------
def test_every_op_has_a_valid_example_and_every_required_field_is_checked() -> None:
    bodies = valid_bodies()
    assert set(bodies) == set(OPS)
    for op, fields in bodies.items():
        fds = [5] if op == "register" else []
        req = parse_request({"op": op, "seq": 1, **fields}, fds)
        assert req.op == op and req.seq == 1
        for name in OPS[op].required:
            broken = {"op": op, "seq": 1, **fields}
            del broken[name]
            with pytest.raises(SchemaError, match=name):
                parse_request(broken, fds)
        with pytest.raises(SchemaError, match="unknown field"):
            parse_request({"op": op, "seq": 1, **fields, "surprise": 1}, fds)
        if OPS[op].token:
            with pytest.raises(SchemaError, match="token"):
                parse_request({"op": op, "seq": 1, **{k: v for k, v in fields.items() if k != "token"}}, fds)


@pytest.mark.parametrize("items,match", [
    ([], r"items.*1\.\.128"), ([{"key": b"k", "offset": 0}] * 129, r"items.*1\.\.128"), ({"key": b"k"}, "items"),
    ([{"key": b"k"}], r"items\[0\]\.offset"), ([{"key": b"", "offset": 0}], r"items\[0\]\.key"),
    ([{"key": b"k", "offset": 0}, {"key": b"k", "offset": -1}], r"items\[1\]\.offset"),
    ([{"key": b"k", "offset": 0, "more": 1}], "unknown field"), ([b"k"], r"items\[0\]"),
])
def test_load_many_items_are_checked_one_by_one(items: object, match: str) -> None:
    body = {"op": "load_many", "seq": 1, **valid_bodies()["load_many"], "items": items}
    with pytest.raises(SchemaError, match=match):
        parse_request(body, [])


@pytest.mark.parametrize("field,value", [
    ("reg", True), ("reg", 0), ("reg", 1 << 63), ("gen", 1.0), ("gen", "2"), ("key", b""), ("key", b"k" * 257),
    ("key", "k"), ("layout_digest", b"d" * 31), ("offset", -1), ("nbytes", 0),
])
def test_wrong_types_and_ranges(field: str, value: object) -> None:
    body = {"op": "save", "seq": 1, **valid_bodies()["save"], field: value}
    with pytest.raises(SchemaError, match=field):
        parse_request(body, [])


def test_admin_field_is_declared_where_admin_ops_are() -> None:
    """The admin token is an optional bin[32] of shutdown / evict / retain / unretain / status / list / hello
    (takeover) only (its absence is the service's not_authorized, not a schema error); anywhere else it is an
    unknown field."""
    assert {op for op, spec in OPS.items() if "admin" in spec.optional} == {"shutdown", "evict", "retain",
                                                                             "unretain", "status", "list", "hello"}
    for op in ("shutdown", "evict", "status", "list"):
        body = {"op": op, "seq": 1, "token": TOKEN, **({"what": "clients"} if op == "list" else {})}
        assert parse_request(body, []).args["admin"] is None
        assert parse_request({**body, "admin": ADMIN}, []).args["admin"] == ADMIN
        for bad in (b"a" * 31, b"a" * 33, "a" * 32, 32):
            with pytest.raises(SchemaError, match="admin"):
                parse_request({**body, "admin": bad}, [])
    with pytest.raises(SchemaError, match="unknown field"):
        parse_request({"op": "heartbeat", "seq": 1, "token": TOKEN, "admin": ADMIN}, [])


def test_unknown_op_and_fd_counts() -> None:
    with pytest.raises(UnknownOpError):
        parse_request({"op": "steal", "seq": 1}, [])
    with pytest.raises(SchemaError, match="file descriptor"):
        parse_request({"op": "heartbeat", "seq": 1, "token": TOKEN}, [3])
    with pytest.raises(SchemaError, match="file descriptor"):
        parse_request({"op": "register", "seq": 1, **valid_bodies()["register"]}, [3, 4])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["op", "seq", "token", "reg", "gen", "key", "layout", "req", "instance",
                                        "kind", "nbytes", "offset", "zzz"]),
                       st.one_of(st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.floats(),
                                 st.text(max_size=8), st.binary(max_size=40), st.sampled_from(list(OPS)),
                                 st.lists(st.integers(), max_size=3)), max_size=8))
def test_any_body_is_a_request_or_a_schema_error(body: dict) -> None:
    try:
        parse_request(body, [])
    except ServiceError as e:
        assert not e.fatal


def test_error_codes_round_trip_to_their_classes() -> None:
    assert len(ERRORS_BY_CODE) == len({c.code for c in ERRORS_BY_CODE.values()})
    for code, cls in ERRORS_BY_CODE.items():
        reply = error_reply(4, cls("why"))
        assert reply["error"]["code"] == code and reply["fatal"] == cls.fatal
        again = error_from_reply(reply["error"]["code"], reply["error"]["message"])
        assert type(again) is cls and "why" in str(again)
    assert type(error_from_reply("no-such-code", "m")) is ServiceError


# -- layout descriptor ---------------------------------------------------------------------------------------
def test_descriptor_size_matches_an_independent_count() -> None:
    import numpy as np

    for packing, heads, dv, extra in (("paged", 2, 64, {}), ("cpu", 3, 64, {}),
                                      ("mla", 1, 0, {"rope_offset": 48})):
        d = descriptor.validate(descriptor.example(num_blocks=5, dtype="float16", packing=packing,
                                                   num_kv_heads=heads, head_dim_v=dv, **extra))
        shape = (d["num_layers"], 5, heads, d["block_size"], 64 + dv)
        assert descriptor.nbytes(d) == np.zeros(shape, dtype=np.float16).nbytes
        assert descriptor.example_nbytes(d) == descriptor.nbytes(d)


@pytest.mark.parametrize("change,field", [
    ({"dtype": "float64"}, "dtype"), ({"order": "XYZ"}, "order"), ({"num_blocks": 0}, "num_blocks"),
    ({"head_dim": True}, "head_dim"), ({"packing": "mla", "num_kv_heads": 2}, "mla"),
    ({"k_scale": float("nan")}, "k_scale"), ({"k_scale": 0.0}, "k_scale"), ({"extra": 1}, "unknown"),
    ({"layer_stride": "4"}, "layer_stride"), ({"packing": "cpu", "order": "LBNHC"}, "cpu"),
    ({"offset": 3}, "offset"),
])
def test_descriptor_refuses_bad_fields(change: dict, field: str) -> None:
    with pytest.raises(SchemaError, match=field):
        descriptor.validate({**descriptor.example(), **change})


def test_descriptor_is_a_kvlayout() -> None:
    from kmesh.kv.layout import KVLayout

    d = descriptor.validate(descriptor.example(num_blocks=3))
    assert d == KVLayout.paged("LBHNC", 2, 3, 16, 2, 64, "bfloat16").to_dict()
    with pytest.raises(SchemaError, match="missing"):
        descriptor.validate({k: v for k, v in d.items() if k != "dtype"})


def test_digests_name_the_exact_layout_and_the_geometry() -> None:
    a, b = descriptor.example(num_blocks=4), descriptor.example(num_blocks=8)
    assert descriptor.digest(a) != descriptor.digest(b)
    assert descriptor.geometry_digest(a) == descriptor.geometry_digest(b)
    assert descriptor.geometry_digest(a) != descriptor.geometry_digest(descriptor.example(num_blocks=4,
                                                                                          dtype="float16"))


# -- the registration state machine ---------------------------------------------------------------------------
class _Mem:
    def __init__(self) -> None:
        self.busy = False
        self.closed = 0


def _registry() -> tuple[Registry, list]:
    unmapped: list = []

    def unmap(reg):
        if reg.memory is not None and reg.memory.busy:
            raise RuntimeError("views alive")
        unmapped.append(reg.reg_id)

    return Registry(unmap), unmapped


def _peer(pid: int = 1) -> identity.Peer:
    return identity.Peer(pid, 0, 0, -1, "none")


def _reg(r: Registry, c, alloc: int = 1, gen: int = 1):
    return r.register(c, alloc, gen, "memfd", 64, LAYOUT, b"d", b"g", handle=None)


def test_transition_table_is_the_documented_lifecycle() -> None:
    order = [State.REGISTERED, State.ACTIVE, State.CLOSING, State.DRAINED, State.RELEASED]
    for a, b in zip(order, order[1:]):
        assert b in NEXT[a]
    assert NEXT[State.REGISTERED] == (State.ACTIVE, State.CLOSING)
    assert NEXT[State.RELEASED] == ()
    assert all(State.RELEASED not in NEXT[s] for s in (State.REGISTERED, State.ACTIVE, State.CLOSING))


def test_close_waits_for_in_flight_work_then_releases() -> None:
    r, unmapped = _registry()
    c = r.add_client(1, "", _peer(), TOKEN, 1, 0.0)
    reg = _reg(r, c)
    with pytest.raises(RegistrationStateError):
        r.begin_work(reg, 1)
    r.activate(reg, _Mem())
    r.begin_work(reg, 1)
    assert r.close(reg, "test") is State.CLOSING and r.close(reg, "again") is State.CLOSING
    assert reg.reason == "test"
    with pytest.raises(RegistrationClosedError):
        r.begin_work(reg, 2)
    assert unmapped == []
    reg.memory.busy = True  # views alive: stays drained, retried later
    r.end_work(reg, 1)
    assert reg.state is State.DRAINED and r.counters["release_deferred"] == 1
    reg.memory.busy = False
    r.settle_all()
    assert unmapped == [reg.reg_id] and reg.reg_id not in r.regs and not r.violations()
    assert [h[0] for h in reg.history] == ["registered", "active", "closing", "drained", "release-deferred",
                                           "released"]
    with pytest.raises(RegistrationClosedError, match="released"):
        r.resolve(c, reg.reg_id, 1)


def test_illegal_transition_is_an_internal_error() -> None:
    r, _ = _registry()
    reg = _reg(r, r.add_client(1, "", _peer(), TOKEN, 1, 0.0))
    with pytest.raises(InternalError):
        r._move(reg, State.RELEASED, "skip the drain")


def test_generations_and_ownership() -> None:
    r, _ = _registry()
    a = r.add_client(1, "", _peer(1), TOKEN, 1, 0.0)
    b = r.add_client(2, "", _peer(2), TOKEN, 2, 0.0)
    g1 = _reg(r, a, alloc=0x7F00, gen=1)
    r.activate(g1, _Mem())
    r.begin_work(g1, 1)
    g2 = _reg(r, a, alloc=0x7F00, gen=2)  # same address, new allocation
    assert g1.state is State.CLOSING and g1.reason == "superseded by generation 2" and g2.reg_id != g1.reg_id
    for gen in (1, 2):
        with pytest.raises(StaleGenerationError):
            _reg(r, a, alloc=0x7F00, gen=gen)
    with pytest.raises(StaleGenerationError):
        r.resolve(a, g2.reg_id, 1)
    with pytest.raises(NotOwnerError):
        r.resolve(b, g2.reg_id, 2)
    with pytest.raises(UnknownRegistrationError):
        r.resolve(a, 999, 1)
    assert _reg(r, b, alloc=0x7F00, gen=1).reg_id not in (g1.reg_id, g2.reg_id)  # other client, own namespace
    assert not r.violations()


def test_claim_on_a_live_instance_is_refused_takeover_closes_never_inherits() -> None:
    r, _ = _registry()
    old = r.add_client(7, "", _peer(1), TOKEN, 1, 0.0)
    reg = _reg(r, old)
    r.activate(reg, _Mem())
    r.begin_work(reg, 1)
    with pytest.raises(InstanceInUseError, match="instance 7"):
        r.add_client(7, "", _peer(2), b"u" * 32, 2, 0.0)
    assert old.live and reg.state is State.ACTIVE and r.counters["instance_refusals"] == 1  # nothing changed
    anon = [r.add_client(None, "", _peer(3), b"v" * 32, 3, 0.0) for _ in range(2)]  # anonymous: no collision
    assert old.live and all(a.live for a in anon)
    new = r.add_client(7, "", _peer(2), b"u" * 32, 2, 0.0, takeover=True)
    assert new.client_id != old.client_id and not old.live and "taken over" in old.lost_reason
    assert r.holder(7) is new
    assert reg.state is State.CLOSING and reg.memory is not None  # closing, never straight to released
    with pytest.raises(NotOwnerError):
        r.resolve(new, reg.reg_id, 1)
    r.end_work(reg, 1)
    assert reg.state is State.RELEASED
    with pytest.raises(NotOwnerError):  # not even the tombstone is the new client's
        r.resolve(new, reg.reg_id, 1)


# -- store -----------------------------------------------------------------------------------------------------
def test_store_originals_are_immutable_pinned_and_evictable() -> None:
    s = Store(1 << 20)
    o = s.begin_put(b"k", 16, LAYOUT, b"g")
    with pytest.raises(ObjectMissingError, match="in flight"):
        s.acquire(b"k")
    o.tensor.copy_(o.tensor.new_tensor(list(range(16))))
    s.commit(o)
    with pytest.raises(ObjectExistsError):
        s.begin_put(b"k", 16, LAYOUT, b"g")
    got = s.acquire(b"k")
    assert s.evict() == {"evicted": [], "kept": [b"k"]}
    s.release(got)
    assert got.describe(verify=True)["sha256_now"] == got.sha256
    assert s.evict(b"k") == {"evicted": [b"k"], "kept": []} and s.used_bytes == 0
    aborted = s.begin_put(b"p", 8, LAYOUT, b"g")
    s.abort(aborted)
    assert s.used_bytes == 0 and b"p" not in s.objects


# -- identity and handles -------------------------------------------------------------------------------------
def test_peer_credentials_and_pidfd() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    p = identity.peer_of(a)
    assert (p.pid, p.uid, p.gid) == (os.getpid(), os.getuid(), os.getgid())
    assert p.pidfd >= 0 and not identity.exited(p.pidfd)
    os.close(p.pidfd)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    fd = os.pidfd_open(pid)
    os.waitpid(pid, 0)
    assert identity.exited(fd)
    os.close(fd)
    a.close()
    b.close()
    assert identity.token_ok(TOKEN, TOKEN) and not identity.token_ok(TOKEN, b"x" * 32)
    assert not identity.token_ok(None, TOKEN)


def test_admin_token_file_is_private_and_checked_on_read(tmp_path) -> None:
    path = tmp_path / "kmesh.admin"
    tok = identity.create_admin_token(path)
    assert len(tok) == 32 and path.stat().st_mode & 0o777 == 0o600
    assert identity.read_admin_token(path) == tok
    again = identity.create_admin_token(path)  # a stale file (dead service) is replaced by a fresh token
    assert again != tok and identity.read_admin_token(path) == again
    assert issubclass(NotAuthorizedError, AuthError) and NotAuthorizedError.code == "not_authorized"
    os.chmod(path, 0o640)  # readable by the group: no longer a capability
    with pytest.raises(NotAuthorizedError, match="0600"):
        identity.read_admin_token(path)
    os.chmod(path, 0o600)
    for bad in (b"", b"zz" * 32, b"ab" * 31 + b"\n", "é".encode() * 32):
        path.write_bytes(bad)
        with pytest.raises(NotAuthorizedError, match="malformed"):
            identity.read_admin_token(path)
    link = tmp_path / "link"
    link.symlink_to(path)
    with pytest.raises(NotAuthorizedError):
        identity.read_admin_token(link)
    with pytest.raises(NotAuthorizedError, match="cannot read"):
        identity.read_admin_token(tmp_path / "missing")


def test_only_sealed_memfds_of_sufficient_size_are_accepted() -> None:
    buf = HostBuffer(8192)
    assert check_memfd(buf.fd, 8192) == buf.tag
    with pytest.raises(HandleError, match="8192 bytes"):
        check_memfd(buf.fd, 8193)
    plain = os.memfd_create("unsealed")
    os.ftruncate(plain, 8192)
    with pytest.raises(HandleError, match="sealed"):
        check_memfd(plain, 8192)
    r, w = os.pipe()
    with pytest.raises(HandleError, match="not a memfd"):
        check_memfd(r, 1)
    with pytest.raises(OSError):
        os.ftruncate(buf.fd, 0)  # the seal holds for the client too
    addr = buf.address
    buf.write(100, b"abc")
    assert buf.read(100, 3) == b"abc"
    buf.close()
    again = HostBuffer(8192, address=addr)  # a new allocation at the same address
    assert again.address == addr and again.read(100, 3) == b"\0\0\0"
    for fd in (plain, r, w):
        os.close(fd)
    again.close()
