"""Every model load is local: the hub is switched off before transformers reads its settings."""
from __future__ import annotations

import os


def go_offline() -> None:
    """Set HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE (call before importing transformers; loads also pass
    local_files_only=True, which holds even if transformers was imported earlier)."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
