"""One request's whole prefill (blend) captured as a CUDA graph, so launch overhead does not decide TTFT.

blend() has no host synchronisation inside its layer loop (kmesh.model.blend), so with its plan made
beforehand the whole loop is capturable. The graph reads the cache and ids it was captured with: a caller
writes new restored state into that same cache (kmesh.restore) and replays. `verify_against_eager` runs the
eager path on the same inputs and compares bit for bit — a graph is only timed after it matched.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from kmesh.model.blend import BlendResult, RepairConfig, blend, plan
from kmesh.model.errors import ModelError
from kmesh.model.runner import KVCache, LayerRunner


class GraphedBlend:
    def __init__(self, runner: LayerRunner, ids: torch.Tensor, cache: KVCache, restored: torch.Tensor,
                 config: RepairConfig, arm: str, warmup: int = 2,
                 chunks: Sequence[tuple[int, int]] | None = None) -> None:
        if runner.device.type != "cuda":
            raise ModelError("CUDA graphs need the runner on a CUDA device")
        self.runner, self.cache, self.restored, self.config, self.arm = runner, cache, restored, config, arm
        self.ids = ids.to(runner.device)
        self.plan = plan(arm, restored, config, runner.num_layers, runner.device, chunks)   # chunks: epic only
        self._pristine = cache.raw.clone()   # the state replays start from (restored K/V as given)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                self._reset()
                blend(runner, self.ids, cache, restored, config, arm, plan_=self.plan)
        torch.cuda.current_stream().wait_stream(side)
        self._reset()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = blend(runner, self.ids, cache, restored, config, arm, plan_=self.plan)
        self._reset()

    def _reset(self) -> None:
        self.cache.raw.copy_(self._pristine)

    def replay(self) -> BlendResult:
        self.graph.replay()
        return self.out

    def verify_against_eager(self) -> dict[str, Any]:
        """Replay and eager blend from the same starting state: logits, masks and cache bytes equal?"""
        self._reset()
        g = self.replay()
        g_logits, g_masks, g_cache = g.logits.clone(), g.masks.clone(), self.cache.raw.clone()
        self._reset()
        e = blend(self.runner, self.ids, self.cache, self.restored, self.config, self.arm, plan_=self.plan)
        same = {"logits": torch.equal(g_logits, e.logits), "masks": torch.equal(g_masks, e.masks),
                "cache_bytes": torch.equal(g_cache, self.cache.raw)}
        self._reset()
        return same
