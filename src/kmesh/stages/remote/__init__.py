"""Stage `remote`: the remote tier on Mooncake Store shared by two hosts (see stage.py)."""
from kmesh.stages.remote.stage import run

__all__ = ["run"]
