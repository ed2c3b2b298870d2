"""The converted SmolLM2 for tests that need real weights: made on first use (the model stage's own conversion,
kmesh.model.smollm2.ensure_converted: one converter per folder at a time, reused while its manifest matches), so
these tests run in a clean clone and in CI instead of skipping until someone has run the model stage.

Under make test (scripts/test.sh exports KMESH_SUITE_MODEL_OVERLAY, its pipeline's overlay) it is the whole model
that pipeline's model stage converts: one conversion between them, whichever comes first, the other reusing it."""
from __future__ import annotations

import functools
import os
from pathlib import Path


@functools.cache
def converted() -> Path:
    from kmesh.config import load_config
    from kmesh.model import smollm2

    overlay = os.environ.get("KMESH_SUITE_MODEL_OVERLAY")
    folder = smollm2.full_dir(load_config(profile="cpu", overlays=[overlay] if overlay else []))
    smollm2.ensure_converted(folder)
    return folder
