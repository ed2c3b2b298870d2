"""Stage `storage`: the equivalence workload's children restore their shared segments from object files on disk
through two storage routes (kmesh.storage), bit-identical to the in-process reference; plus the O_DIRECT floor,
checksum arms and read-once serving. The case list is in stage.py; one module per concern:

    setup           the model stage setup with the stage's object directory and I/O settings
    stage           run(cfg): objects, routes, reference, matched route pairs; calls the others in order
    objects         object files per segment and a storage-backed SegmentSource (StorageSegments)
    child           one child through a route, timed read ⊂ check ⊂ restore ⊂ outer
    controls        arrival checks (complemented bytes) and bad-file failure controls
    floor           the route vs the raw O_DIRECT floor; io_uring vs preadv
    pipeline        the pipelined restore the floor variants time (read i+1 while i is checked)
    checksums       checksum arms (CPU / GPU SHA-256, sha256-tree, BLAKE3, overlapped)
    checksum_cases  the cases that run them
    readonce        read-once serving through kmesh.storage.tier vs forced eviction
    service         the same through the cache service process
"""
from kmesh.stages.storage.stage import run

__all__ = ["run"]
