"""Who is on the other end of a connection: kernel peer credentials, a pidfd for liveness, a secret token.

- SO_PEERCRED gives (pid, uid, gid) as the kernel saw them at connect(); the client cannot forge them.
- SO_PEERPIDFD (Linux >= 6.5) gives a pidfd for exactly that process, so a recycled pid can never be mistaken
  for the client; older kernels fall back to pidfd_open(pid), which has a small reuse window (recorded in
  `Peer.pidfd_source`). A pidfd becomes readable when the process exits: the server polls it in its selector.
- The token is 32 random bytes issued by hello; every later request on that connection must present it.
"""
from __future__ import annotations

import hmac
import os
import secrets
import select
import socket
import struct
from dataclasses import dataclass

from kmesh.service.errors import AuthError

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
