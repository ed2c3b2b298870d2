"""KMesh: reuse shared attention state (KV cache) across requests, processes and storage."""

__version__ = "0.1.0"
