"""Integrity failures (the registry, the CPU and GPU implementations and the tree format raise them)."""
from __future__ import annotations

from kmesh.errors import KMeshError


class IntegrityError(KMeshError):
    """Root of integrity failures."""


class UnknownAlgorithmError(IntegrityError):
    """An object names an integrity algorithm this build does not know."""


class DigestMismatchError(IntegrityError):
    """The bytes do not hash to the recorded digest."""

    def __init__(self, algorithm: str, expected: bytes, actual: bytes, what: str = "object") -> None:
        super().__init__(f"{what}: {algorithm} digest mismatch (recorded {expected.hex()[:16]}…, "
                         f"computed {actual.hex()[:16]}…)")
        self.algorithm, self.expected, self.actual = algorithm, expected, actual
