"""Stage `drain`: no memory is reused before accepted copies physically complete (write-up §23); the copying is
done by a separate process. The case list is in stage.py.

    stage      run(cfg): the settings and the seven cases in order
    cases      one transfer case through the copier; the copier killed mid-copy
    owner      the owner's shared-memory buffers with canaries, the would-be reuser, leak counters
    copier     the owner's handle on the copier process (control socket, pidfd, per-case gate)
    client     the copier process itself: `python -m kmesh.stages.drain.client`
    protocol   what both processes agree on (canary size, poison byte)
"""
from kmesh.stages.drain.stage import run

__all__ = ["run"]
