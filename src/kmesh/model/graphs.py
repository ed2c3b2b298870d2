"""A prefill captured as a CUDA graph, so launch overhead does not decide TTFT.

GraphedBlend: one request's whole prefill (blend). blend() has no host synchronisation inside its layer loop
(kmesh.model.blend), so with its plan made beforehand the whole loop is capturable. The graph reads the cache
and ids it was captured with: a caller writes new restored state into that same cache (kmesh.kv.restore) and
replays. GraphedRun: any such callable (the group stage's arms: restore + prefill of every member).
`verify_against_eager` runs the eager path on the same inputs and compares bit for bit — a graph is only timed
after it matched.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch

from kmesh.model.blend import BlendResult, RepairConfig, blend, plan
from kmesh.model.errors import ModelError
from kmesh.model.runner import KVCache, LayerRunner


def _capture(fn: Callable[[], Any], warmup: int, before: Callable[[], None]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """fn run `warmup` times on a side stream (allocator and compiled kernels settle), then captured once;
    `before()` runs ahead of every warm-up run and of the capture. Returns (graph, fn's outputs at capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            before()
            fn()
    torch.cuda.current_stream().wait_stream(side)
    before()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, NaN included (torch.equal calls NaN unequal to itself)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


class GraphedRun:
    """`fn()` — no host synchronisation inside, returning {name: tensor} — captured as one CUDA graph.

    `state` are the tensors fn writes (the members' caches): verify_against_eager poisons them (NaN) before the
    replay and before an eager fn() and compares the outputs and the state byte for byte, so a slot the graph
    leaves unwritten, or writes otherwise than the eager run, shows."""

    def __init__(self, fn: Callable[[], Mapping[str, torch.Tensor]], state: Sequence[torch.Tensor],
                 warmup: int = 2) -> None:
        if not state or any(t.device.type != "cuda" for t in state):
            raise ModelError("CUDA graphs need the state on a CUDA device")
        self.fn, self.state = fn, list(state)
        self.graph, self.out = _capture(fn, warmup, lambda: None)

    def replay(self) -> Mapping[str, torch.Tensor]:
        self.graph.replay()
        return self.out

    def _poison(self) -> None:
        for t in self.state:
            t.fill_(float("nan") if t.is_floating_point() else -1)

    def verify_against_eager(self) -> dict[str, Any]:
        """Replay and eager fn() from the same poisoned state: every output and every state byte equal?"""
        self._poison()
        g_out = {n: x.clone() for n, x in self.replay().items()}
        g_state = [t.clone() for t in self.state]
        self._poison()
        e_out = self.fn()
        same_out = {n: n in e_out and _bytes_equal(g_out[n], e_out[n]) for n in g_out}
        same_state = all(_bytes_equal(a, b) for a, b in zip(g_state, self.state))
        return {"outputs": same_out, "state_bytes": same_state,
                "equal": bool(same_out) and set(g_out) == set(e_out) and all(same_out.values()) and same_state}


class GraphedBlend:
    def __init__(self, runner: LayerRunner, ids: torch.Tensor, cache: KVCache, restored: torch.Tensor,
                 config: RepairConfig, arm: str, warmup: int = 2,
                 chunks: Sequence[tuple[int, int]] | None = None) -> None:
        if runner.device.type != "cuda":
            raise ModelError("CUDA graphs need the runner on a CUDA device")
        if config.selection_seed is not None:   # its scores come from the host: a replay would reuse the first's
            raise ModelError("the chance control (selection_seed) runs eagerly, never in a CUDA graph")
        self.runner, self.cache, self.restored, self.config, self.arm = runner, cache, restored, config, arm
        self.ids = ids.to(runner.device)
        self.plan = plan(arm, restored, config, runner.num_layers, runner.device, chunks)   # chunks: epic only
        self._pristine = cache.raw.clone()   # the state replays start from (restored K/V as given)
        self.graph, self.out = _capture(lambda: blend(runner, self.ids, cache, restored, config, arm, plan_=self.plan),
                                        warmup, self._reset)
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
