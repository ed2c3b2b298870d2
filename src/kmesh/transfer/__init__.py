"""kmesh.transfer — the copy engine with holds and drain (DESIGN §2 `transfer`, write-up §23).

    eng = TransferEngine("cuda")                    # or "cpu"
    t = eng.submit(src, dst, owner="req-7")         # async; holds on src and dst
    try:
        ...
    except TransferError as e:
        eng.drain(e.pending)                        # finish accepted work before reusing memory
    eng.drain(owner="req-7")                        # holds drop only once copies physically completed
    eng.release(dst)                                # raises BufferHeldError while still held
"""
from kmesh.transfer.engine import DrainReport, Ticket, TicketState, TransferEngine
from kmesh.transfer.errors import (BufferHeldError, CompletionCheckError, DrainRefusedError, DrainTimeoutError,
                                   EngineClosedError, HolderAliveError, SubmitError, TransferArgumentError,
                                   TransferError)
from kmesh.transfer.faults import ChunkGate, FaultPlan
from kmesh.transfer.ledger import LedgerHold, SharedLedger

__all__ = [
    "TransferEngine", "Ticket", "TicketState", "DrainReport", "FaultPlan", "ChunkGate", "SharedLedger",
    "LedgerHold", "TransferError", "TransferArgumentError", "SubmitError", "DrainRefusedError",
    "DrainTimeoutError", "CompletionCheckError", "BufferHeldError", "HolderAliveError", "EngineClosedError",
]
