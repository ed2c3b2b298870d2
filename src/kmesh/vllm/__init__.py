"""Integration with the pinned vLLM (0.32). Every import of vllm is local to a function here, so modules
that GPU stages need never import vLLM (the GPU machine has none)."""
from __future__ import annotations


def available() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None
