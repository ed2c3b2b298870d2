"""Object files: round trip, atomic write, and every kind of bad file refused with its own error."""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import struct

import pytest

from kmesh.storage import objfile as of
from kmesh.storage.errors import (BadMagicError, BadVersionError, HeaderCorruptError, HeaderLieError,
                                  ObjectAlgorithmError, ObjectCorruptError, ObjectNotFoundError, ObjectReplacedError,
                                  ShortFileError, StorageError)

PAYLOAD = bytes(range(256)) * 37 + b"tail"      # 9476 B: not a 4 KiB multiple, so there is padding


def _write(tmp_path, payload=PAYLOAD, **kw):
    p = tmp_path / "obj.kmo"
    return p, of.write_object(p, payload, b"seg/0", {"order": "BLNHC"}, **kw)


def _rewrite_header(p, mutate):
    """Re-encode the header with `mutate(dict)` applied and a VALID header checksum: a consistent lie."""
    raw = bytearray(p.read_bytes())
    magic, ver, n, _ = struct.unpack_from("<8sII32s", raw)
    d = json.loads(raw[48:48 + n])
    mutate(d)
    body = json.dumps(d, sort_keys=True).encode()
    raw[:of.HEADER_BYTES] = (struct.pack("<8sII32s", magic, ver, len(body), hashlib.sha256(body).digest()) + body
                             ).ljust(of.HEADER_BYTES, b"\0")
    p.write_bytes(raw)


def test_round_trip_layout_and_padding(tmp_path):
    p, h = _write(tmp_path)
    raw = p.read_bytes()
    assert raw[:8] == b"KMESHOBJ" and len(raw) == of.HEADER_BYTES + 3 * 4096 == h.file_nbytes
    assert h.padded_nbytes == 12288 and h.payload_nbytes == len(PAYLOAD)
    assert raw[of.HEADER_BYTES:of.HEADER_BYTES + len(PAYLOAD)] == PAYLOAD
    assert raw[of.HEADER_BYTES + len(PAYLOAD):] == bytes(12288 - len(PAYLOAD))
    # the digest is the plain sha256 of the whole padded object (the write-up's format)
    assert h.digest == hashlib.sha256(raw[of.HEADER_BYTES:]).digest()
    h2, buf = of.read_object(p)
    assert h2 == h and bytes(buf[:len(PAYLOAD)]) == PAYLOAD
    assert h2.layout == {"order": "BLNHC"} and h2.key == b"seg/0"     # what was written, not just self-consistent
    assert not [x for x in os.listdir(tmp_path) if ".tmp-" in x]      # no temp file left behind
    assert os.stat(p).st_mode & 0o777 == 0o644 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_a_parametrized_algorithm_round_trips_with_its_params(tmp_path):
    """sha256-tree with its chunk size: the digest written is the one the reader recomputes with those params."""
    p, h = _write(tmp_path, algorithm="sha256-tree", params={"chunk_bytes": 1024})
    h2, buf = of.read_object(p)
    assert h2.params == {"chunk_bytes": 1024} and h2.digest == h.digest
    assert bytes(buf[:len(PAYLOAD)]) == PAYLOAD


def test_empty_payload_and_a_pad_equal_to_the_payload(tmp_path):
    p, h = _write(tmp_path, payload=b"")
    assert h.padded_nbytes == 0 and h.payload_nbytes == 0
    assert of.read_object(p)[0] == h                                # a header-only file reads back
    _, h = _write(tmp_path, payload=bytes(8192), pad_to=8192)     # exactly the payload: allowed
    assert h.padded_nbytes == 8192


def test_pad_to_fixed_size_and_bad_pad(tmp_path):
    _, h = _write(tmp_path, pad_to=3 << 20)
    assert h.padded_nbytes == 3 << 20
    with pytest.raises(StorageError):
        _write(tmp_path, pad_to=4096)        # smaller than the payload
    with pytest.raises(StorageError):
        _write(tmp_path, pad_to=(3 << 20) + 1)


def test_atomic_replace_keeps_old_until_rename(tmp_path, monkeypatch):
    p, h = _write(tmp_path)

    def boom(*a):
        raise OSError("disk full")
    monkeypatch.setattr(of.os, "fsync", boom)
    with pytest.raises(OSError):
        of.write_object(p, b"new" * 5000, b"seg/0")
    monkeypatch.undo()
    assert of.read_object(p)[0] == h                                     # the old object survives intact
    assert not [x for x in os.listdir(tmp_path) if ".tmp-" in x]


def test_missing(tmp_path):
    with pytest.raises(ObjectNotFoundError):
        of.ObjectFile.open(tmp_path / "nope")


def test_wrong_magic(tmp_path):
    p, _ = _write(tmp_path)
    raw = bytearray(p.read_bytes()); raw[0] ^= 0xFF; p.write_bytes(raw)
    with pytest.raises(BadMagicError):
        of.read_object(p)


def test_wrong_version(tmp_path):
    p, _ = _write(tmp_path)
    raw = bytearray(p.read_bytes()); struct.pack_into("<I", raw, 8, 2); p.write_bytes(raw)
    with pytest.raises(BadVersionError):
        of.read_object(p)


def test_header_bit_flip_fails_its_checksum(tmp_path):
    p, _ = _write(tmp_path)
    raw = bytearray(p.read_bytes()); raw[60] ^= 0x01; p.write_bytes(raw)
    with pytest.raises(HeaderCorruptError):
        of.read_object(p)


@pytest.mark.parametrize("cut", [10, of.HEADER_BYTES - 1, of.HEADER_BYTES + 100, -1])
def test_short_file(tmp_path, cut):
    p, _ = _write(tmp_path)
    raw = p.read_bytes()
    p.write_bytes(raw[:cut])
    with pytest.raises(ShortFileError):
        of.read_object(p)


def test_payload_bit_flip_and_nonzero_padding(tmp_path):
    p, _ = _write(tmp_path)
    raw = bytearray(p.read_bytes()); raw[of.HEADER_BYTES + 5] ^= 0x10; p.write_bytes(raw)
    with pytest.raises(ObjectCorruptError):
        of.read_object(p)
    p, _ = _write(tmp_path)
    raw = bytearray(p.read_bytes()); raw[-1] = 1; p.write_bytes(raw)     # padding is covered by the digest
    with pytest.raises(ObjectCorruptError):
        of.read_object(p)


@pytest.mark.parametrize("lie,err", [
    (lambda d: d.update(padded_nbytes=d["padded_nbytes"] + 4096), ShortFileError),   # claims more than on disk
    (lambda d: d.update(padded_nbytes=d["padded_nbytes"] - 4096), HeaderLieError),   # disk has more than it says
    (lambda d: d.update(payload_nbytes=d["padded_nbytes"] + 1), HeaderLieError),     # payload beyond the padding
    (lambda d: d.update(padded_nbytes=d["padded_nbytes"] - 1), HeaderLieError),      # not 4 KiB aligned
    (lambda d: d.update(alignment=512), HeaderLieError),
    (lambda d: d["integrity"].update(digest="ab" * 8), HeaderLieError),              # digest of the wrong size
    (lambda d: d["integrity"].update(digest="00" * 32), ObjectCorruptError),         # right size, wrong value
    (lambda d: d["integrity"].update(algorithm="md5"), ObjectAlgorithmError),        # unknown name refused
    (lambda d: d["integrity"].update(params={"chunk": 1}), ObjectAlgorithmError),
    (lambda d: d.update(payload_nbytes="9476"), HeaderCorruptError),
    (lambda d: d.pop("key"), HeaderCorruptError),
])
def test_lying_headers(tmp_path, lie, err):
    p, _ = _write(tmp_path)
    _rewrite_header(p, lie)
    with pytest.raises(err):
        of.read_object(p)


def test_an_unaligned_padded_size_is_a_lie_even_when_the_file_matches_it(tmp_path):
    """The alignment check itself (not the size check after it): the file cut to exactly what the header claims."""
    p, _ = _write(tmp_path)
    _rewrite_header(p, lambda d: d.update(padded_nbytes=d["padded_nbytes"] - 1))
    raw = p.read_bytes()
    p.write_bytes(raw[:-1])                     # header + padded - 1 bytes: the size the lie claims
    with pytest.raises(HeaderLieError, match=r"not a 4096 B multiple"):
        of.read_object(p)


def test_header_json_may_fill_the_block_exactly_and_not_one_byte_more(tmp_path):
    room = of.HEADER_BYTES - struct.calcsize("<8sII32s")

    def fill(extra):
        def mutate(d):
            d["layout"]["note"] = ""
            d["layout"]["note"] = "x" * (room + extra - len(json.dumps(d, sort_keys=True).encode()))
        return mutate

    p, _ = _write(tmp_path)
    _rewrite_header(p, fill(0))
    header, payload = of.read_object(p)         # exactly the block: read as written
    assert bytes(payload[:len(PAYLOAD)]) == PAYLOAD and len(header.layout["note"]) > 0
    raw = bytearray(p.read_bytes())
    raw[8 + 4:8 + 8] = struct.pack("<I", room + 1)   # one byte more than the block holds
    p.write_bytes(raw)
    with pytest.raises(HeaderCorruptError, match="overruns"):
        of.read_object(p)


def test_a_header_that_fills_the_block_exactly_is_written_and_one_byte_more_is_refused(tmp_path):
    import dataclasses

    _, h = _write(tmp_path)
    room = of.HEADER_BYTES - struct.calcsize("<8sII32s")
    base = len(dataclasses.replace(h, layout={"note": ""}).to_json())
    exact = {"note": "x" * (room - base)}
    p = tmp_path / "exact.kmo"
    written = of.write_object(p, PAYLOAD, b"seg/0", exact)
    assert len(written.to_json()) == room and of.read_object(p)[0].layout == exact
    with pytest.raises(StorageError, match="does not fit"):
        of.write_object(p, PAYLOAD, b"seg/0", {"note": "x" * (room - base + 1)})


def test_unknown_algorithm_refused_at_write(tmp_path):
    with pytest.raises(ObjectAlgorithmError):
        of.write_object(tmp_path / "x", b"abc", b"k", algorithm="no-such-algo")


def test_replaced_while_open(tmp_path):
    p, _ = _write(tmp_path)
    f = of.ObjectFile.open(p)
    buf = bytearray(f.header.padded_nbytes)
    os.preadv(f.fd, [buf], of.HEADER_BYTES)
    f.header.verify(buf)                       # what we read is intact ...
    of.write_object(p, b"other" * 3000, b"seg/0")
    with pytest.raises(ObjectReplacedError):   # ... but the path now names another object
        f.check_unchanged()
    f.close()


def test_modified_in_place_while_open(tmp_path):
    p, _ = _write(tmp_path)
    with of.ObjectFile.open(p) as f:
        st = os.stat(p)
        with open(p, "r+b") as w:
            w.seek(of.HEADER_BYTES)
            w.write(b"X")
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))    # coarse clocks: make the change visible
        with pytest.raises(ObjectReplacedError):
            f.check_unchanged()


def test_o_direct_open_reads_header(tmp_path):
    p, h = _write(tmp_path)
    try:
        f = of.ObjectFile.open(p, os.O_DIRECT)
    except OSError as e:
        pytest.skip(f"no O_DIRECT on this filesystem: {e}")
    with f:
        assert f.header == h
        assert fcntl.fcntl(f.fd, fcntl.F_GETFL) & os.O_DIRECT      # the route reads through O_DIRECT indeed
    f.close()                                                       # closing again is harmless


def test_fuzzed_headers_never_escape_as_other_errors(tmp_path):
    """Any corruption of the header block or a truncation: a StorageError (specific), or the exact object."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    p, h = _write(tmp_path)
    good = p.read_bytes()

    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.lists(st.tuples(st.integers(0, of.HEADER_BYTES - 1), st.integers(0, 255)), min_size=1, max_size=6),
           st.integers(0, len(good)))
    def check(edits, cut):
        raw = bytearray(good)
        for i, v in edits:
            raw[i] = v
        p.write_bytes(bytes(raw[:cut]))
        try:
            h2, buf = of.read_object(p)
        except StorageError:
            return
        assert raw[:cut] == good                                     # only an edit that changed nothing passes
        assert h2 == h and bytes(buf) == good[of.HEADER_BYTES:]

    check()
