"""KMesh repair: our own implementation of CacheBlend's selective recomputation, plus the controls it is
compared with, all through one layer-wise runner (kmesh.model.runner).

A request's cache holds restored K/V (already moved to the new positions by kmesh.kv.restore) at the positions
`restored` marks; every other position has no data. `blend()` prefills the request layer by layer:

repair  layers before the first check layer: every position recomputed (their inputs differ from the
        leader's, so nothing restored can be trusted yet). At a check layer: fresh K (or V) of every
        restored position is compared with the restored one, ‖fresh − restored‖² over heads and channels
        in float32, and the top ceil(ratio × restored) positions stay recomputed from then on. Positions
        WITHOUT restored data, and the last position (its hidden state gives the next token), are always
        recomputed. Queries attend with the TRUE causal mask by position.
stock   stock CacheBlend as LMCache implements it: check layer(s) as configured (1), top int(ratio × T) over
        ALL positions by post-RoPE K deviation, positions without cached data hold zeros (they are only
        recomputed if the ranking picks them), recomputed queries attend with a bottom-right-aligned causal
        mask (a dense flash-attn call with causal=True and q_len < k_len); next-token logits come from the
        last recomputed row, as its dense path returns them. With RepairConfig.recompute_counts the
        budget is a fixed number of positions per check layer instead of the ratio: the stock-matched
        control, given exactly the repair arm's recomputed count (every position it recomputes, restored or
        not), so the two selection rules are compared at one budget.
naive   restored positions reuse their (shifted) K/V at every layer, no repair; others recomputed.
epic    EPIC's LegoLink rule (Hu et al., ICML 2025), from the paper's description: the first k tokens of every
        restored chunk are recomputed at every layer (they absorb the attention-sink effect a chunk learned at
        the start of its own prompt), with every position without restored data and the last one; every other
        restored position reuses its shifted K/V at every layer, like naive. No check layer: which positions are
        recomputed is fixed by the chunk boundaries, so blend() needs them (`chunks`: [start, end) per restored
        chunk, as the workload placed them; adjacent chunks are not one run). k = RepairConfig.epic_tokens.
full    every position recomputed at every layer: the reference (a plain prefill through the runner).

Per-layer recompute masks (bool [layers, T]) are returned. blend() is a loop of BlendState.step() (one layer
each), so a group of requests can interleave the same steps layer-major (kmesh.model.group). The loop has no
host synchronisation once it starts (selection is a device top-k of static size), so one request's whole blend
can be captured in a CUDA graph (kmesh.model.graphs).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

import torch

from kmesh.model.errors import ModelError
from kmesh.model.runner import KVCache, LayerRunner

# "repair" is KMesh's repair arm (not "kmesh": that names the project and the vLLM engine arm)
Arm = Literal["full", "naive", "stock", "repair", "epic"]
ARMS: tuple[str, ...] = ("full", "naive", "stock", "repair", "epic")
REUSE_ARMS = ("naive", "epic")    # a fixed set of positions is recomputed; the rest reuse restored K/V throughout


class RepairConfigError(ModelError):
    """A repair setting is out of range (check layer, ratio, deviation)."""


@dataclass(frozen=True)
class RepairConfig:
    check_layers: tuple[int, ...] = (1,)
    recompute_ratio: float | tuple[float, ...] = 0.15   # one ratio, or one per check layer (non-increasing)
    deviation: Literal["k", "v"] = "k"
    # stock arm only: positions kept after each check layer instead of the ratio (the stock-matched budget,
    # set per request to the repair arm's recomputed count; never read from the config file)
    recompute_counts: tuple[int, ...] | None = None
    epic_tokens: int = 16    # epic arm: leading tokens of every restored chunk recomputed (EPIC's k)
    # repair arm only, a control: rows ranked by a seeded random score instead of their deviation, at the same
    # budget (chance at the repair's budget, the equivalence stage's quality case; never read from the config file)
    selection_seed: int | None = None

    def ratios(self) -> tuple[float, ...]:
        r = self.recompute_ratio
        return tuple(r) if isinstance(r, (tuple, list)) else (float(r),) * len(self.check_layers)

    def validate(self, num_layers: int) -> None:
        try:
            self._validate(num_layers)
        except (TypeError, ValueError) as e:  # mixed / non-numeric entries
            raise RepairConfigError(f"invalid repair config {self}: {e}") from e

    def _validate(self, num_layers: int) -> None:
        if not self.check_layers or sorted(set(self.check_layers)) != list(self.check_layers):
            raise RepairConfigError(f"check_layers must be a non-empty increasing list, got {self.check_layers}")
        if not all(type(c) is int and 0 <= c < num_layers for c in self.check_layers):
            raise RepairConfigError(f"check_layers {self.check_layers} outside the model's {num_layers} layers")
        ratios = self.ratios()
        if len(ratios) != len(self.check_layers):
            raise RepairConfigError(f"{len(ratios)} ratios for {len(self.check_layers)} check layers")
        if not all(0.0 < r <= 1.0 for r in ratios) or list(ratios) != sorted(ratios, reverse=True):
            raise RepairConfigError(f"recompute ratios must be in (0, 1] and non-increasing, got {ratios}")
        if self.deviation not in ("k", "v"):
            raise RepairConfigError(f"deviation must be 'k' or 'v', got {self.deviation!r}")
        if type(self.epic_tokens) is not int or self.epic_tokens < 0:
            raise RepairConfigError(f"epic_tokens must be an integer >= 0, got {self.epic_tokens!r}")
        counts = self.recompute_counts
        if counts is not None:
            if len(counts) != len(self.check_layers):
                raise RepairConfigError(f"{len(counts)} recompute counts for {len(self.check_layers)} check layers")
            if not all(type(n) is int and n >= 1 for n in counts) or list(counts) != sorted(counts, reverse=True):
                raise RepairConfigError(f"recompute counts must be positive integers, non-increasing, got {counts}")
        if self.selection_seed is not None and (type(self.selection_seed) is not int or self.selection_seed < 0):
            raise RepairConfigError(f"selection_seed must be an integer >= 0 or None, got {self.selection_seed!r}")

    @classmethod
    def from_dict(cls, d: dict) -> "RepairConfig":
        r = d.get("recompute_ratio", 0.15)
        return cls(tuple(d.get("check_layers", (1,))), tuple(r) if isinstance(r, list) else float(r),
                   d.get("deviation", "k"), epic_tokens=d.get("epic_tokens", 16))


def matched_stock(stock: RepairConfig, masks: torch.Tensor) -> RepairConfig:
    """The stock rule at another arm's budget for one request (the stock-matched control): at each of stock's
    check layers, as many positions as that arm's per-layer recompute masks (bool [layers, T]) recomputed there."""
    counts = tuple(int(masks[layer].sum()) for layer in stock.check_layers)
    return replace(stock, recompute_counts=counts)


@dataclass
class BlendResult:
    logits: torch.Tensor            # next-token logits [vocab] (model dtype)
    masks: torch.Tensor             # bool [layers, T]: positions recomputed at each layer
    arm: str
    recomputed: list[int] = field(default_factory=list)   # per layer, filled by counts()

    def counts(self) -> list[int]:
        self.recomputed = [int(x) for x in self.masks.sum(1).tolist()]
        return self.recomputed


@dataclass(frozen=True)
class BlendPlan:
    """What blend() decides before its loop from the host-side restored mask (static sizes only)."""

    arm: str
    T: int
    forced: torch.Tensor        # int64 positions always recomputed (repair, naive: missing + last; epic: + chunk heads)
    is_forced: torch.Tensor     # the same as a bool [T] mask
    keep: tuple[int, ...]       # per check layer: how many rows survive the selection
    check_layers: tuple[int, ...]
    deviation: str
    selection_seed: int | None = None   # the chance control: rows ranked by a seeded random score (RepairConfig)


def _chunk_heads(r: torch.Tensor, chunks: Sequence[tuple[int, int]] | None, k: int) -> torch.Tensor:
    """bool [T]: the first k positions of every chunk (epic). Chunks must be restored, in-bounds, disjoint."""
    T = r.numel()
    if chunks is None:
        raise ModelError("the epic arm needs the restored chunks' [start, end) spans (blend(..., chunks=...))")
    heads = torch.zeros(T, dtype=torch.bool)
    spans = sorted((int(a), int(b)) for a, b in chunks)
    for (a, b), nxt in zip(spans, [*spans[1:], (T, T)]):
        if not 0 <= a < b <= min(T, nxt[0]):
            raise ModelError(f"chunks {spans} must be non-empty, disjoint and inside the {T}-position prompt")
        if not bool(r[a:b].all()):
            raise ModelError(f"chunk [{a}, {b}) is not wholly restored")
        heads[a:min(a + k, b)] = True
    return heads


def plan(arm: str, restored: Sequence[bool] | torch.Tensor, config: RepairConfig, num_layers: int,
         device: torch.device, chunks: Sequence[tuple[int, int]] | None = None) -> BlendPlan:
    if arm not in ARMS:
        raise ModelError(f"arm must be one of {ARMS}, got {arm!r}")
    config.validate(num_layers)
    if config.recompute_counts is not None and arm != "stock":
        raise RepairConfigError(f"recompute_counts is the stock arm's fixed budget, not the {arm!r} arm's")
    if config.selection_seed is not None and arm != "repair":
        raise RepairConfigError(f"selection_seed is the repair arm's chance control, not the {arm!r} arm's")
    r = torch.as_tensor(restored, dtype=torch.bool).cpu()
    T = r.numel()
    if T == 0:
        raise ModelError("empty prompt")
    forced = ~r
    if arm == "epic":
        forced |= _chunk_heads(r, chunks, config.epic_tokens)
    if arm in ("repair", *REUSE_ARMS):  # the last position's hidden state gives the next token: always computed
        forced[T - 1] = True
    n_forced, n_restored = int(forced.sum()), int((~forced).sum())
    if arm == "repair":
        keep = tuple(n_forced + math.ceil(q * n_restored) for q in config.ratios())
    elif arm == "stock" and config.recompute_counts is not None:
        if config.recompute_counts[0] > T:
            raise RepairConfigError(f"recompute counts {config.recompute_counts} exceed the prompt's {T} positions")
        keep = config.recompute_counts
    elif arm == "stock":
        keep = tuple(max(int(T * q), 1) for q in config.ratios())
    else:
        keep = ()
    checks = config.check_layers if arm in ("repair", "stock") else ()
    return BlendPlan(arm, T, forced.nonzero()[:, 0].to(device), forced.to(device), keep, tuple(checks),
                     config.deviation, config.selection_seed)


def deviation(fresh: torch.Tensor, cached: torch.Tensor) -> torch.Tensor:
    """Per-row ‖fresh − cached‖² over heads and channels in float32 (rows [n, heads, D] -> [n]).

    Each row is reduced on its own, so the rows of several requests stacked into one call give each
    request's deviations bit for bit (the group path batches this; tests check it)."""
    return ((fresh.float() - cached.float()) ** 2).sum(dim=(1, 2))


def pick(p: BlendPlan, i: int, dev: torch.Tensor, forced_rows: torch.Tensor | None) -> torch.Tensor:
    """Sorted row indices that stay recomputed after check layer i, from the rows' deviations."""
    if p.selection_seed is not None:   # the chance control: the same budget, ranked by a seeded random score
        g = torch.Generator().manual_seed(p.selection_seed * 1000 + i)
        dev = torch.rand(dev.shape, generator=g, dtype=torch.float32).to(dev.device)
    # topk ranks NaN above +inf: a NaN deviation (broken restored data) must rank below the forced rows.
    dev = torch.nan_to_num(dev, nan=torch.finfo(dev.dtype).max)
    if forced_rows is not None:  # repair: forced positions always survive, the rest compete
        dev = dev.masked_fill(forced_rows, float("inf"))
    k = min(p.keep[i], dev.numel())
    return torch.sort(torch.topk(dev, k, sorted=False).indices).values


def _select(p: BlendPlan, i: int, rows_pos: torch.Tensor, fresh: torch.Tensor, cached: torch.Tensor,
            forced_rows: torch.Tensor | None) -> torch.Tensor:
    """Sorted row indices that stay recomputed after check layer i."""
    return pick(p, i, deviation(fresh, cached), forced_rows)


class BlendState:
    """One request's prefill in progress: everything blend() carries from one layer to the next.

    `step()` runs the next layer; blend() is a loop of steps, and kmesh.model.group interleaves the steps of
    several requests layer-major (or runs the same pieces batched). A step makes no host synchronisation.
    """

    def __init__(self, runner: LayerRunner, ids: torch.Tensor, cache: KVCache, p: BlendPlan) -> None:
        # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
        with torch.no_grad():
            T, dev = p.T, runner.device
            ids = ids.to(dev)
            if ids.numel() != T or cache.capacity < T:
                raise ModelError(f"{ids.numel()} ids / cache of {cache.capacity} slots for a {T}-position plan")
            self.runner, self.cache, self.plan = runner, cache, p
            self.layer = 0
            if p.arm == "stock":  # no data is zeros, not whatever the buffer held
                for layer in range(runner.num_layers):
                    cache.write_distinct(layer, p.forced, torch.zeros_like(cache.k[layer][p.forced]),
                                         torch.zeros_like(cache.v[layer][p.forced]))
            self.active = p.forced if p.arm in REUSE_ARMS else torch.arange(T, device=dev)
            self.h = runner.embed(ids[self.active])
            self.rot = runner.rotary(self.active)
            self.masks = torch.zeros(runner.num_layers, T, dtype=torch.bool, device=dev)
            self.mask_kind = "bottom_right" if p.arm == "stock" else "position"

    @property
    def done(self) -> bool:
        return self.layer >= self.runner.num_layers

    def check_index(self, layer: int) -> int | None:
        """Which check layer `layer` is (None: not one)."""
        return self.plan.check_layers.index(layer) if layer in self.plan.check_layers else None

    def all_rows(self, layer: int) -> bool:
        """Known on the host: the rows are still every position in order (before any selection / full arm)."""
        p = self.plan
        return p.arm not in REUSE_ARMS and (not p.check_layers or layer < p.check_layers[0])

    def deviation_inputs(self, layer: int, k: torch.Tensor,
                         v: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(fresh, restored) rows a check layer compares: K or V of the active positions."""
        if self.plan.deviation == "k":
            return k, self.cache.k[layer][self.active]
        return v, self.cache.v[layer][self.active]

    def forced_rows(self) -> torch.Tensor | None:
        return self.plan.is_forced[self.active] if self.plan.arm == "repair" else None

    def keep_rows(self, rows: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Narrow the state (hidden rows, rotary rows, active positions) and this layer's q/k/v to `rows`."""
        self.h = self.h[rows]
        self.rot = (self.rot[0][rows], self.rot[1][rows])
        self.active = self.active[rows]
        return q[rows], k[rows], v[rows]

    def check(self, layer: int, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Check layer i: K (or V) of every active row compared with the restored, the state narrowed to the rows
        that stay, and q, k, v of those rows. Q is projected only for the kept rows: the dropped ones need none."""
        runner, p = self.runner, self.plan
        x, k, v = runner.check_qkv(layer, self.h, self.rot, with_v=p.deviation == "v")
        rows = _select(p, i, self.active, *self.deviation_inputs(layer, k, v), self.forced_rows())
        x, k, v = x[rows], k[rows], (None if v is None else v[rows])
        self.h, self.rot, self.active = self.h[rows], (self.rot[0][rows], self.rot[1][rows]), self.active[rows]
        q, v = runner.kept_qv(layer, x, self.rot, v)
        return q, k, v

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """This layer's fresh K/V of the active positions into the cache, and the layer's recompute mask."""
        if self.all_rows(layer):   # a plain copy into slots 0..T-1 instead of a scatter (the same bytes land)
            self.cache.write_prefix(layer, k, v)
            self.masks[layer].fill_(True)
            return
        self.cache.write_distinct(layer, self.active, k, v)   # active positions are distinct by construction
        self.masks[layer].index_fill_(0, self.active, True)   # a scalar fill: no host tensor (CUDA-graph capturable)

    def step(self) -> None:
        """Run the next layer."""
        # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
        with torch.no_grad():
            layer, runner, p = self.layer, self.runner, self.plan
            i = self.check_index(layer)
            if i is None:
                q, k, v = runner.qkv(layer, self.h, self.active, self.rot)
            else:   # only the compared projection for every row; Q (and V) for the rows that stay
                q, k, v = self.check(layer, i)
            self.store(layer, k, v)
            kc, vc = self.cache.layer_kv(layer, p.T)
            a = runner.attend(q, self.active, kc, vc, mask=self.mask_kind, all_rows=self.all_rows(layer))
            self.h = runner.finish_layer(layer, self.h, a)
            self.layer += 1

    def result(self) -> BlendResult:
        # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
        with torch.no_grad():
            if not self.done:
                raise ModelError(f"blend stopped at layer {self.layer} of {self.runner.num_layers}")
            return BlendResult(self.runner.logits(self.h[-1:])[0], self.masks, self.plan.arm)


def blend(runner: LayerRunner, ids: torch.Tensor, cache: KVCache, restored: Sequence[bool] | torch.Tensor,
          config: RepairConfig = RepairConfig(), arm: str = "repair", plan_: BlendPlan | None = None,
          chunks: Sequence[tuple[int, int]] | None = None) -> BlendResult:
    """One request's prefill over a cache holding restored K/V at `restored` positions (see module doc);
    `chunks` ([start, end) of each restored chunk) only for the epic arm."""
    # not @torch.no_grad(): mutmut leaves decorated functions unmutated (pyproject [tool.mutmut])
    with torch.no_grad():
        p = plan_ or plan(arm, restored, config, runner.num_layers, runner.device, chunks)
        state = BlendState(runner, ids, cache, p)
        for _ in range(runner.num_layers):
            state.step()
        return state.result()
