"""Object files: one saved object per file, laid out for O_DIRECT and verified before use (DESIGN.md §2).

    [0, 4096)            header block: prefix + JSON, zero filled
        prefix           magic b"KMESHOBJ" | version u32 | json length u32 | sha256 of the JSON (32 B)   (little endian)
        JSON             key (hex), payload_nbytes, padded_nbytes, alignment, layout,
                         integrity {algorithm, params, digest}
    [4096, 4096+padded)  payload, then zero padding up to padded_nbytes (a multiple of 4096, >= payload_nbytes)

The integrity digest covers the whole padded object (payload + padding; `sha256` is the write-up's format); its
algorithm is looked up by NAME in kmesh.integrity, an unknown name is refused. Writes are atomic: a temp file in
the same directory, fsync, rename over the final name, fsync of the directory — a reader sees the old file or
the new one, never half of one. A reader checks the header (own checksum, magic, version, sizes against the file
on disk), reads the payload through some route, verifies the digest, and checks the path still names the same
unmodified file it opened (`ObjectFile.check_unchanged`).
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kmesh import integrity
from kmesh.storage.errors import (BadMagicError, BadVersionError, HeaderCorruptError, HeaderLieError,
                                  ObjectAlgorithmError, ObjectCorruptError, ObjectNotFoundError, ObjectReplacedError,
                                  ShortFileError, StorageError)

MAGIC = b"KMESHOBJ"
VERSION = 1
ALIGN = 4096                       # O_DIRECT: file offsets, sizes and buffer addresses in multiples of this
HEADER_BYTES = ALIGN
_PREFIX = struct.Struct("<8sII32s")
DEFAULT_ALGORITHM = "sha256"


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class Header:
    key: bytes
    payload_nbytes: int
    padded_nbytes: int
    algorithm: str
    digest: bytes
    params: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)

    @property
    def file_nbytes(self) -> int:
        return HEADER_BYTES + self.padded_nbytes

    def to_json(self) -> bytes:
        return json.dumps({"key": self.key.hex(), "payload_nbytes": self.payload_nbytes,
                           "padded_nbytes": self.padded_nbytes, "alignment": ALIGN, "layout": self.layout,
                           "integrity": {"algorithm": self.algorithm, "params": self.params,
                                         "digest": self.digest.hex()}}, sort_keys=True).encode()

    def encode(self) -> bytes:
        body = self.to_json()
        if _PREFIX.size + len(body) > HEADER_BYTES:
            raise StorageError(f"object header of {len(body)} B does not fit the {HEADER_BYTES} B header block")
        block = _PREFIX.pack(MAGIC, VERSION, len(body), hashlib.sha256(body).digest()) + body
        return block + bytes(HEADER_BYTES - len(block))

    def verify(self, padded: Any, what: str = "object") -> None:
        """Raise ObjectCorruptError unless `padded` (the payload + padding, any buffer) hashes to the digest."""
        mv = memoryview(padded).cast("B")
        if mv.nbytes != self.padded_nbytes:
            raise ShortFileError(f"{what}: {mv.nbytes} bytes to check, the header says {self.padded_nbytes}")
        try:
            integrity.verify(self.algorithm, mv, self.digest, what=what, **self.params)
        except integrity.DigestMismatchError as e:
            raise ObjectCorruptError(str(e)) from e
        except integrity.IntegrityError as e:
            raise ObjectAlgorithmError(f"{what}: {e}") from e


def _field(d: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    v = d.get(name)
    if not isinstance(v, kind) or isinstance(v, bool):
        raise HeaderCorruptError(f"object header field {name!r} is {type(v).__name__}, not {kind}")
    return v


def parse_header(block: bytes, file_nbytes: int, what: str = "object file") -> Header:
    """Decode and check a header block against the size of the file it came from."""
    if file_nbytes < HEADER_BYTES or len(block) < HEADER_BYTES:
        raise ShortFileError(f"{what}: {min(file_nbytes, len(block))} bytes, shorter than the {HEADER_BYTES} B header")
    magic, version, n, body_sha = _PREFIX.unpack_from(block)
    if magic != MAGIC:
        raise BadMagicError(f"{what}: magic {magic!r} is not {MAGIC!r}")
    if version != VERSION:
        raise BadVersionError(f"{what}: format version {version}, this build reads {VERSION}")
    if n > HEADER_BYTES - _PREFIX.size:
        raise HeaderCorruptError(f"{what}: header JSON of {n} B overruns the header block")
    body = bytes(block[_PREFIX.size:_PREFIX.size + n])
    if hashlib.sha256(body).digest() != body_sha:
        raise HeaderCorruptError(f"{what}: header checksum mismatch")
    if any(block[_PREFIX.size + n:HEADER_BYTES]):
        raise HeaderCorruptError(f"{what}: non-zero bytes after the header JSON")
    try:
        d = json.loads(body)
        integ = _field(d, "integrity", dict)
        h = Header(bytes.fromhex(_field(d, "key", str)), _field(d, "payload_nbytes", int),
                   _field(d, "padded_nbytes", int), _field(integ, "algorithm", str),
                   bytes.fromhex(_field(integ, "digest", str)), _field(integ, "params", dict),
                   _field(d, "layout", dict))
        alignment = _field(d, "alignment", int)
    except (ValueError, UnicodeDecodeError) as e:
        raise HeaderCorruptError(f"{what}: header is not valid JSON of the expected shape: {e}") from e
    if alignment != ALIGN or h.padded_nbytes % ALIGN or h.padded_nbytes < 0:
        raise HeaderLieError(f"{what}: padded size {h.padded_nbytes} / alignment {alignment} not a {ALIGN} B multiple")
    if not 0 <= h.payload_nbytes <= h.padded_nbytes:
        raise HeaderLieError(f"{what}: payload {h.payload_nbytes} B does not fit the padded {h.padded_nbytes} B")
    if file_nbytes < h.file_nbytes:
        raise ShortFileError(f"{what}: {file_nbytes} bytes on disk, the header says {h.file_nbytes}")
    if file_nbytes > h.file_nbytes:
        raise HeaderLieError(f"{what}: {file_nbytes} bytes on disk, the header says only {h.file_nbytes}")
    try:
        algo = integrity.get(h.algorithm)
    except integrity.UnknownAlgorithmError as e:
        raise ObjectAlgorithmError(f"{what}: {e}") from e
    if set(h.params) - set(algo.params):
        extra = sorted(set(h.params) - set(algo.params))
        raise ObjectAlgorithmError(f"{what}: {h.algorithm} takes no parameter(s) {extra}")
    if len(h.digest) != algo.digest_size:
        raise HeaderLieError(f"{what}: a {len(h.digest)} B digest, {h.algorithm} digests are {algo.digest_size} B")
    return h


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _padded_and_header(payload: Any, key: bytes, layout: dict[str, Any] | None, algorithm: str,
                       params: dict[str, Any] | None, pad_to: int | None) -> tuple[Header, bytearray]:
    data = memoryview(payload).cast("B")
    padded = round_up(max(data.nbytes, pad_to or 0))
    if pad_to is not None and (pad_to % ALIGN or pad_to < data.nbytes):
        raise StorageError(f"pad_to {pad_to} must be a {ALIGN} B multiple >= the {data.nbytes} B payload")
    buf = bytearray(padded)
    buf[:data.nbytes] = data
    params = dict(params or {})
    try:
        digest = integrity.get(algorithm).digest(buf, **params)
    except integrity.IntegrityError as e:
        raise ObjectAlgorithmError(str(e)) from e
    return Header(bytes(key), data.nbytes, padded, algorithm, digest, params, dict(layout or {})), buf


def encode_image(payload: Any, key: bytes, layout: dict[str, Any] | None = None,
                 algorithm: str = DEFAULT_ALGORITHM, params: dict[str, Any] | None = None) -> bytes:
    """The bytes an object file holds (header block + padded payload), for a tier that stores them elsewhere
    (kmesh.storage.remote): the same header, digest and checks as on disk."""
    h, buf = _padded_and_header(payload, key, layout, algorithm, params, None)
    return h.encode() + bytes(buf)


def decode_image(image: Any, key: bytes, what: str = "object") -> tuple[Header, memoryview]:
    """Check an object image before any of it is used: header (own checksum, magic, version, sizes against the
    image's length), the key it names, the digest of the padded payload by the algorithm the header names.
    Returns (header, the payload without padding). StorageError subclasses say what is wrong."""
    mv = memoryview(image).cast("B")
    h = parse_header(bytes(mv[:HEADER_BYTES]), mv.nbytes, what=what)
    if h.key != bytes(key):
        raise HeaderLieError(f"{what}: the header names key {h.key[:64]!r}, it was fetched as {bytes(key)[:64]!r}")
    padded = mv[HEADER_BYTES:]
    h.verify(padded, what)
    return h, padded[:h.payload_nbytes]


def write_object(path: str | os.PathLike[str], payload: Any, key: bytes, layout: dict[str, Any] | None = None,
                 algorithm: str = DEFAULT_ALGORITHM, params: dict[str, Any] | None = None,
                 pad_to: int | None = None) -> Header:
    """Write one object file atomically; returns its header. `pad_to` pads the payload to at least that many
    bytes (a 4096 multiple), e.g. the write-up's 3 MiB objects."""
    path = Path(path)
    h, buf = _padded_and_header(payload, key, layout, algorithm, params, pad_to)
    head = h.encode()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        try:
            for chunk in (head, buf):
                view = memoryview(chunk)
                while view.nbytes:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return h


@dataclass
class ObjectFile:
    """An open object file: checked header, the identity of what was opened, a read-only fd for routes."""

    path: Path
    fd: int
    header: Header
    ident: tuple[int, int, int, int]     # st_dev, st_ino, st_size, st_mtime_ns at open

    @classmethod
    def open(cls, path: str | os.PathLike[str], flags: int = 0) -> "ObjectFile":
        """Open and check the header. `flags` adds to O_RDONLY (O_DIRECT for the direct-I/O routes); the header
        itself is read through a second, buffered descriptor of the same open file."""
        path = Path(path)
        try:
            fd = os.open(path, os.O_RDONLY | flags)
        except FileNotFoundError as e:
            raise ObjectNotFoundError(f"no object file {path}") from e
        try:
            st = os.fstat(fd)
            hfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY) if flags else fd
            try:
                block = os.pread(hfd, HEADER_BYTES, 0)
            finally:
                if hfd != fd:
                    os.close(hfd)
            header = parse_header(block, st.st_size, what=str(path))
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, header, (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))

    @property
    def payload_offset(self) -> int:
        return HEADER_BYTES

    def check_unchanged(self) -> None:
        """After reading: the open file was not modified and the path still names it (not replaced by a rename)."""
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns) != self.ident[2:]:
            raise ObjectReplacedError(f"{self.path} was modified while open")
        try:
            now = os.stat(self.path)
        except FileNotFoundError as e:
            raise ObjectReplacedError(f"{self.path} was removed while open") from e
        if (now.st_dev, now.st_ino) != self.ident[:2]:
            raise ObjectReplacedError(f"{self.path} was replaced while open (another file now has its name)")

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "ObjectFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_object(path: str | os.PathLike[str]) -> tuple[Header, bytearray]:
    """Buffered read of a whole object, verified: (header, padded payload). For tiers and tools, not benchmarks."""
    with ObjectFile.open(path) as f:
        buf = bytearray(f.header.padded_nbytes)
        n = os.preadv(f.fd, [buf], HEADER_BYTES)
        if n != len(buf):
            raise ShortFileError(f"{path}: read {n} of {len(buf)} payload bytes")
        f.header.verify(buf, str(path))
        f.check_unchanged()
        return f.header, buf
