"""The converted SmolLM2 for tests that need real weights: made on first use (the model stage's own conversion,
kmesh.model.smollm2.ensure_converted: one converter per folder at a time, reused while its manifest matches), so
these tests run in a clean clone and in CI instead of skipping until someone has run the model stage."""
from __future__ import annotations

import functools
from pathlib import Path


@functools.cache
def converted() -> Path:
    from kmesh.config import load_config
    from kmesh.model import smollm2

    folder = smollm2.converted_dir(load_config(profile="cpu"))
    smollm2.ensure_converted(folder)
    return folder
