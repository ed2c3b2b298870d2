"""Fault injection for the transfer engine, usable by tests and pipeline stages.

A FaultPlan is plain data (it crosses process boundaries as a dict). The ChunkGate makes "a copy still in
flight" deterministic: a gated copy moves one chunk per token, and tokens come from a pipe that the test
controls, possibly from another process. No sleeps decide anything.
"""
from __future__ import annotations

import os
import select
from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class FaultPlan:
    """Where the engine should fail on purpose.

    fail_after_submit: the first N submits accept and start the copy, then raise SubmitError(pending=[ticket]).
    refuse_first_drain: the first N drains raise DrainRefusedError without waiting; holds stay.
    fail_completion_check: the first N completion checks raise CompletionCheckError (drain fails, holds stay).
    fail_copy_at_chunk: the copy itself errors before this chunk index (the ticket ends "failed", partial data).
    kill_after_chunks: after this many chunks of a copy, SIGKILL the process that owns the copy.
    chunk_bytes: copy granularity when a gate or a chunk fault is in use.
    """

    fail_after_submit: int = 0
    refuse_first_drain: int = 0
    fail_completion_check: int = 0
    fail_copy_at_chunk: int | None = None
    kill_after_chunks: int | None = None
    chunk_bytes: int = 1 << 20

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "FaultPlan":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            from kmesh.transfer.errors import TransferArgumentError

            raise TransferArgumentError(f"unknown fault field(s) {unknown}; known: {sorted(known)}")
        return cls(**d)

    def take(self, name: str) -> bool:
        """Consume one count of a counting fault; True if it fires now."""
        n = getattr(self, name)
        if n > 0:
            setattr(self, name, n - 1)
            return True
        return False


class ChunkGate:
    """A token pipe: each gated chunk takes one byte; the controller grants chunks, or opens the gate for good.

    The copying side holds `read_fd` (inheritable across exec via pass_fds); the controller holds the write end.
    Closing the write end opens the gate forever (read sees EOF).
    """

    def __init__(self, read_fd: int | None = None, write_fd: int | None = None) -> None:
        if read_fd is None:
            read_fd, write_fd = os.pipe()
        self.read_fd = read_fd
        self.write_fd = write_fd
        self._open = False

    @classmethod
    def from_read_fd(cls, fd: int) -> "ChunkGate":
        return cls(read_fd=fd, write_fd=None)

    def allow(self, n: int = 1) -> None:
        """Grant n more chunks (controller side)."""
        if self.write_fd is None:
            raise RuntimeError("this side of the gate only reads")
        os.write(self.write_fd, b"\x01" * n)

    def open(self) -> None:
        """Let every remaining chunk through (controller side): close the write end."""
        if self.write_fd is not None:
            os.close(self.write_fd)
            self.write_fd = None

    def opened_for_good(self) -> bool:
        """Copying side, without taking a token: has the controller opened the gate for good (closed its write
        end)? A pipe whose writers are all gone polls as hung up, tokens still in it or not; those tokens no
        longer pace anything, since nothing can follow them but the open gate."""
        if self._open:
            return True
        if self.read_fd is None:
            return False
        poller = select.poll()
        poller.register(self.read_fd, select.POLLIN | select.POLLHUP)
        if any(ev & select.POLLHUP for _, ev in poller.poll(0)):
            self._open = True
        return self._open

    def wait(self, timeout: float | None = None) -> bool:
        """Copying side: take one token (or see the gate open). False if the timeout passed first."""
        if self._open:
            return True
        r, _, _ = select.select([self.read_fd], [], [], timeout)
        if not r:
            return False
        if os.read(self.read_fd, 1) == b"":
            self._open = True
        return True

    def close(self) -> None:
        self.open()
        if self.read_fd is not None:
            os.close(self.read_fd)
            self.read_fd = None  # type: ignore[assignment]
