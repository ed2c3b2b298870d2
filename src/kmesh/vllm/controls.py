"""The connector's negative-control switch: the kv_connector_extra_config key and the faults it knows.

Its own module, free of vLLM imports, so the vllm stage can name it on a host without vLLM (the GPU host), where
the stage runs only its engine-free case and skips the rest."""
from __future__ import annotations

# Only the vllm stage's control engine sets it; no config file or default does.
NEGATIVE_CONTROL = "negative_control"
NEGATIVE_CONTROL_FAULTS = ("skip_write",)
