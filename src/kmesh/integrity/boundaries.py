"""Message lengths that exercise every branch of the hash implementations (the integrity stage's CPU and GPU
checks share them)."""
from __future__ import annotations


def boundary_lengths(chunk: int) -> list[int]:
    """Lengths around every boundary the implementations branch on: SHA-256 blocks and padding (55/56/64), BLAKE3
    blocks and chunks (64, 1024), tree chunks, one block of 256 leaves/chunks, a second pass (256² leaves)."""
    edges = {0, 1, 55, 56, 63, 64, 65, 119, 120, 1023, 1024, 1025, 2047, 2048, 2049, 3072, 3 * 1024 * 1024,
             chunk - 1, chunk, chunk + 1, 256 * chunk - 1, 256 * chunk, 256 * chunk + 1, 256 * 1024 + 1,
             257 * 1024, 256 * 256 * chunk + 1}
    return sorted(n for n in edges if n >= 0)
