"""Stage `peers`: vLLM alone vs vLLM + LMCache (its MP server) vs vLLM + KMesh, side by side in one run.

Parts: stage (the cases), servers (the two servers behind one interface), lmcache_server (LMCache's MP server as its
users start it, and its own statistics).
"""
from kmesh.stages.peers.stage import run

__all__ = ["run"]
