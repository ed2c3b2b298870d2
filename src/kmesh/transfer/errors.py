"""Typed transfer errors. Every one carries the tickets still pending, so a caller can always drain them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from kmesh.errors import KMeshError

if TYPE_CHECKING:
    from kmesh.transfer.engine import Ticket


class TransferError(KMeshError):
    """Base of transfer errors. `.pending`: the accepted tickets that are not drained yet (drain them)."""

    def __init__(self, message: str, pending: Iterable["Ticket"] = ()) -> None:
        self.pending: list["Ticket"] = list(pending)
        ids = [t.id for t in self.pending]
        super().__init__(f"{message} (pending tickets: {ids})" if ids else message)


class TransferArgumentError(TransferError):
    """submit() got tensors it cannot copy (size, contiguity, device); nothing was accepted."""


class SubmitError(TransferError):
    """submit() failed AFTER the copy was accepted: the copy runs on; `.pending` holds its ticket."""


class DrainRefusedError(TransferError):
    """A drain did not finish the work (injected refusal); holds stay until a later drain succeeds."""


class DrainTimeoutError(DrainRefusedError):
    """A drain ran out of time before the copies physically completed; holds stay."""


class CompletionCheckError(TransferError):
    """Asking whether a copy completed failed (e.g. an event query error); holds stay, nothing is assumed done."""


class BufferHeldError(TransferError):
    """A buffer was released (or reclaimed) while tickets still hold it; `.pending` names them."""


class HolderAliveError(TransferError):
    """Holds of another process were to be reaped while that process may still be copying."""


class EngineClosedError(TransferError):
    """The engine was closed; it accepts no new work."""
