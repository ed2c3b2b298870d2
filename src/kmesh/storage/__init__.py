"""Storage: object files on disk and the routes that bring them back into (device) memory.

    objfile   one object per file: header (magic, version, layout, sizes, integrity algorithm + digest),
              payload padded to 4 KiB for O_DIRECT, atomic writes, verified reads
    aligned   page-aligned host buffers (mmap), optionally page-locked for CUDA
    routes    buffered / O_DIRECT (CPU), staging (O_DIRECT -> pinned host -> device), direct (cuFile); each
              reports what actually ran
    cufile    cuFile mode detection (nvidia-fs, P2PDMA, compat) and the cuFile read
    tier      the disk tier under a host-RAM tier: explicit eviction, singleflight loads, group retention
"""
