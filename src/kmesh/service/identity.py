"""Who is on the other end of a connection: kernel peer credentials, a pidfd for liveness, a secret token.

- SO_PEERCRED gives (pid, uid, gid) as the kernel saw them at connect(); the client cannot forge them.
- SO_PEERPIDFD (Linux >= 6.5) gives a pidfd for exactly that process, so a recycled pid can never be mistaken
  for the client; older kernels fall back to pidfd_open(pid), which has a small reuse window (recorded in
  `Peer.pidfd_source`). A pidfd becomes readable when the process exits: the server polls it in its selector.
- The token is 32 random bytes issued by hello; every later request on that connection must present it.
- The admin token is a separate capability: 32 random bytes the service writes at start into a 0600 file in
  its runtime dir. Admin ops (shutdown, status / lists of all clients and of the store, evict, taking over a live
  client's instance) must present it, so a client of the same uid that merely connects (a buggy worker) cannot
  stop the service or touch other clients' state; tools that
  administer the service (`kmesh service stop|status`, the stage harness) read the file deliberately.
"""
from __future__ import annotations

import hmac
import os
import secrets
import select
import socket
import struct
from dataclasses import dataclass
from pathlib import Path

from kmesh.service.errors import AuthError, NotAuthorizedError

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux uapi value; Python 3.11 lacks the constant
_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int
    pidfd: int
    pidfd_source: str  # "SO_PEERPIDFD" | "pidfd_open" | "none"


def peer_of(sock: socket.socket) -> Peer:
    """Credentials and a pidfd of the connected peer (the caller owns the pidfd and must close it)."""
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    try:
        fd = sock.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
        return Peer(pid, uid, gid, fd, "SO_PEERPIDFD")
    except OSError:
        pass
    try:
        return Peer(pid, uid, gid, os.pidfd_open(pid), "pidfd_open")
    except (OSError, AttributeError):
        return Peer(pid, uid, gid, -1, "none")


def check_allowed(peer: Peer, allowed_uids: frozenset[int]) -> None:
    if peer.uid not in allowed_uids:
        raise AuthError(f"peer uid {peer.uid} (pid {peer.pid}) is not served here; allowed uids "
                        f"{sorted(allowed_uids)}")


def exited(pidfd: int) -> bool:
    """True once the process behind pidfd has exited (pidfd polls readable)."""
    if pidfd < 0:
        return False
    r, _, _ = select.select([pidfd], [], [], 0)
    return bool(r)


def new_token() -> bytes:
    return secrets.token_bytes(32)


def token_ok(expected: bytes | None, presented: bytes | None) -> bool:
    return expected is not None and presented is not None and hmac.compare_digest(expected, presented)


def create_admin_token(path: Path) -> bytes:
    """A fresh admin token, written (hex) to a new 0600 file at path; a stale file of a dead service is replaced."""
    token = secrets.token_bytes(32)
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, token.hex().encode() + b"\n")
    finally:
        os.close(fd)
    return token


def read_admin_token(path: Path) -> bytes:
    """The admin token in path. NotAuthorizedError if it is missing, unreadable, malformed, or not a private
    (0600-or-stricter) file of our own uid (a file anyone else could have written is no capability)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise NotAuthorizedError(f"cannot read the admin token {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise NotAuthorizedError(f"admin token {path} must be our own 0600 file; it is uid {st.st_uid}, "
                                     f"mode {st.st_mode & 0o777:o}")
        data = os.read(fd, 256)
    finally:
        os.close(fd)
    try:
        token = bytes.fromhex(data.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        token = b""
    if len(token) != 32:
        raise NotAuthorizedError(f"admin token {path} is malformed")
    return token
