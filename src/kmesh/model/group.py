"""Layer-major execution of a request group (write-up §25): every member through layer l before any enters l+1.

    members = [Member("A", ids_a, cache_a, restored_a), ...]       # private caches, restored inputs in place
    out = blend_group(runner, members, repair)                       # unbatched: each member's own blend steps
    out = blend_group(runner, members, repair, batched=True,         # batched group math (repair / full arms)
                      restore=LayerwiseRestore(runner, parts))        #   + restored keys moved per layer, together

Unbatched, a member runs exactly blend()'s steps (kmesh.model.blend.BlendState) in another order of members,
so its K/V, logits and masks are bit-identical to a serial blend() — the order of independent requests cannot
change a request's arithmetic.

Batched, one layer of the whole group is one pass: the rows of every member (ragged: each keeps its own
recomputed subset) are stacked for the Q/K/V projections, o_proj and the MLP; the check layer's deviation is
one reduction over the stacked rows; attention (`attention="member"`, the default) is each member's own
runner.attend over its own cache — the kernel its serial prefill runs (on CUDA the position-causal Triton kernel) —
or (`attention="padded"`) one SDPA call over a padded [members, heads, rows, keys] batch with each member's
position mask as a dense boolean mask. On the H200, every arm graphed, RAG 4k: with the padded call a batched group
of one ran 1.47× its serial time (7.93 vs 5.41 ms, d4a9a14) and four children were 0.99× as fast as serial; with
each member's own kernel a group of one ran 1.07× its serial time (5.95 vs 5.58 ms) and four children 1.24× faster
than serial (42774b8). A dense mask keeps SDPA off its fused kernels and the padding is computed, while attention
holds no weights: batching it saves only launches, which a graph removes. And (with `restore`) the restored keys
of all members' placements are moved to their new positions by one rotation per layer. Numerical bound, per piece:
  rotation, deviation  elementwise / per-row reductions of the same length: bit-identical to unbatched
                       (tests/test_group_math.py asserts it);
  GEMMs, attention     a matrix product over more rows may take another kernel or blocking, so a row's
                       summation order can change: not guaranteed bit-identical. The group stage measures the
                       max |batched − unbatched| of K, V and logits, and requires equal masks and tokens.
What a group can compute once, and what stays per child (issue 22 item 5; RAG groups hold the same chunks):
  once      the restored K/V themselves: one original per chunk in the service, whatever N (group stage's
            bytes-held); and at layer 0, a chunk token's embedding, input norm and pre-RoPE Q/K/V projections,
            which see the token alone (not its context), so they are equal in every child that holds the chunk.
  per child the RoPE shift of a chunk (new − old position: children place chunks at different positions; a
            rotation could be shared only by children that put a chunk at the same place), and everything from
            layer 0's attention on: a row attends over its own child's context in its own order, so its attention
            output, o_proj, MLP and every later layer's input differ between children — including the check
            layer's deviation and hence which rows each child recomputes.
  worth     on the Qwen2.5-0.5B shape, layer 0's Q/K/V projections are ~7 % of a layer's linear work per row
            (896 × 1152 of ~14.9 M multiply-adds); a repair at 0.15 on the RAG shape computes ~6.4 rows per
            prompt token over its layers (layers 0 and 1 in full, ~20 % of the rows after), so computing the
            chunks' layer-0 projections once would save ≈ 1 % of a member's linear work (arithmetic from the
            shapes, not measured). It is not done: batching gains by reading each layer's weights once for every
            member's rows and by launching one kernel for all of them, which `batched=True` does.
A member whose `after_layer` hook raises MemberFailure leaves the group at that layer (its state is dropped;
the caller drains and recomputes it); the others go on, unaffected.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from kmesh.kv.restore import KVSegment
from kmesh.kv.rope import apply_rotation, shift_tables
from kmesh.model.blend import BlendPlan, BlendResult, BlendState, RepairConfig, deviation, pick, plan
from kmesh.model.errors import ModelError
from kmesh.model.runner import KVCache, LayerRunner


class MemberFailure(ModelError):
    """A group member failed between layers; it leaves the group, the others continue."""


class InjectedMemberFault(MemberFailure):
    """A failure injected on purpose (the group stage's failure case)."""


@dataclass
class Member:
    name: str
    ids: torch.Tensor
    cache: KVCache            # the member's private working cache (restored inputs already in place, or
    restored: torch.Tensor    # written layer by layer by a LayerwiseRestore); bool [T]
    arm: str = "repair"
    chunks: tuple[tuple[int, int], ...] | None = None   # the epic arm's restored chunks, [start, end) each


@dataclass
class GroupResult:
    results: dict[str, BlendResult] = field(default_factory=dict)   # members that finished
    failed: dict[str, tuple[int, str]] = field(default_factory=dict)  # name -> (layer it failed after, why)
    order: list[tuple[int, str]] = field(default_factory=list)       # (layer, member) in execution order


@dataclass
class RestorePart:
    """One member's restored inputs: captured segments (keys rotated at their saved positions) and where
    they go in the member's cache (slot = position)."""

    cache: KVCache
    segment: KVSegment
    new_positions: torch.Tensor


class LayerwiseRestore:
    """Every member's restored inputs, moved to the member's positions one layer at a time, all members'
    placements in one rotation per layer (the batched RoPE adjustment of the shared segments).

    Same math as kmesh.kv.restore's torch path: one rotation by (new − old)·ω from tables computed in float64
    from the original positions, elementwise in float32; tokens that do not move and values are copied.
    Memory: it holds one copy of every member's restored inputs (all layers) until the group is done — the
    price of writing them layer by layer (a serial restore writes all layers up front and frees its copy)."""

    def __init__(self, runner: LayerRunner, parts: Sequence[RestorePart]) -> None:
        if not parts:
            raise ModelError("a layer-wise restore needs at least one member")
        lay = parts[0].cache.layout
        if lay.fp8_dtype is not None or lay.rope_offset != 0:
            raise ModelError("the group restore handles the runner's own caches (no fp8, rope at channel 0)")
        self.rope = runner.rope
        dev = parts[0].cache.raw.device
        self.k = torch.cat([p.segment.k for p in parts])          # [tokens of all placements, L, H, D]
        self.v = torch.cat([p.segment.v for p in parts])
        old = torch.cat([p.segment.positions.to(dev, torch.int64) for p in parts])
        new = torch.cat([p.new_positions.to(dev, torch.int64) for p in parts])
        self.cos, self.sin = shift_tables(old, new, self.rope)
        self.moved = old != new
        self.bounds = [0]
        for p in parts:
            self.bounds.append(self.bounds[-1] + p.segment.num_tokens)
        self.placement_tokens = int(self.k.shape[0])
        # only the concatenated copy is kept (the per-member captures can go): where each member's rows land
        self.targets = [(p.cache, p.new_positions) for p in parts]

    def layer(self, layer: int) -> None:
        """Write layer `layer` of every member's restored inputs into its cache."""
        rd = self.rope.rotary_dim
        x = self.k[:, layer]                                       # [n, H, D]
        y = apply_rotation(x, self.cos, self.sin, self.rope)[..., :rd]
        keys = x.clone()
        # a select, not a boolean index: no host synchronisation (CUDA-graph capturable), the same bytes land
        keys[..., :rd] = torch.where(self.moved[:, None, None], y, x[..., :rd])
        for (cache, pos), a, b in zip(self.targets, self.bounds, self.bounds[1:]):
            cache.write_distinct(layer, pos, keys[a:b], self.v[a:b, layer])   # a member's placements are disjoint

    def all_layers(self) -> None:
        for layer in range(self.k.shape[1]):
            self.layer(layer)


def _batched_attention(runner: LayerRunner, states: Sequence[BlendState], layer: int,
                       qs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each member's queries over its own cache, one SDPA call for the group: padded to the longest member's
    rows and keys, each member masked by true position (padding queries see everything; dropped after)."""
    n_h, hd, dev = runner.num_heads, runner.head_dim, runner.device
    Ts = [s.plan.T for s in states]
    sizes = [q.shape[0] for q in qs]
    same_T = len(set(Ts)) == 1
    if same_T and all(s.all_rows(layer) for s in states):  # every member: all positions in order (causal)
        q = torch.stack(qs).transpose(1, 2)                   # [N, heads, T, D]
        kv = [s.cache.layer_kv(layer, s.plan.T) for s in states]
        k = torch.stack([a for a, _ in kv]).transpose(1, 2)
        v = torch.stack([b for _, b in kv]).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=runner.scale,
                                             enable_gqa=runner.groups > 1)
        return [o.transpose(0, 1).reshape(n, n_h * hd) for o, n in zip(out, sizes)]
    _N, Tmax = len(states), max(Ts)
    q = pad_sequence(list(qs), batch_first=True)                                  # [N, nmax, heads, D]
    qpos = pad_sequence([s.active for s in states], batch_first=True, padding_value=Tmax - 1)
    kv = [s.cache.layer_kv(layer, s.plan.T) for s in states]
    if same_T:
        k, v = torch.stack([a for a, _ in kv]), torch.stack([b for _, b in kv])  # [N, T, kv_heads, D]
    else:
        k, v = pad_sequence([a for a, _ in kv], batch_first=True), pad_sequence([b for _, b in kv], batch_first=True)
    kpos = torch.arange(Tmax, device=dev)
    allowed = kpos[None, None, :] <= qpos[:, :, None]                            # [N, nmax, Tmax]
    if not same_T:   # keys past a member's own prompt are padding (compared with scalars: no host copy)
        allowed &= torch.stack([kpos < t for t in Ts])[:, None, :]
    kk = k.repeat_interleave(runner.groups, dim=2).transpose(1, 2)
    vv = v.repeat_interleave(runner.groups, dim=2).transpose(1, 2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), kk, vv, attn_mask=allowed[:, None], scale=runner.scale)
    return [out[i, :, :n].transpose(0, 1).reshape(n, n_h * hd) for i, n in enumerate(sizes)]


def _batched_step(runner: LayerRunner, states: Sequence[BlendState], attention: str = "member") -> None:
    """One layer of every member in one pass (see module doc)."""
    layer = states[0].layer
    sizes = [s.active.numel() for s in states]
    h = torch.cat([s.h for s in states])
    pos = torch.cat([s.active for s in states])
    rot = (torch.cat([s.rot[0] for s in states]), torch.cat([s.rot[1] for s in states]))
    q, k, v = runner.qkv(layer, h, pos, rot)
    qs, ks, vs = list(q.split(sizes)), list(k.split(sizes)), list(v.split(sizes))
    checks = [(j, s.check_index(layer)) for j, s in enumerate(states)]
    checks = [(j, i) for j, i in checks if i is not None]
    if checks:  # one deviation reduction over every checking member's rows
        pairs = [states[j].deviation_inputs(layer, ks[j], vs[j]) for j, _ in checks]
        devs = deviation(torch.cat([f for f, _ in pairs]), torch.cat([c for _, c in pairs]))
        for (j, i), dev in zip(checks, devs.split([sizes[j] for j, _ in checks])):
            s = states[j]
            rows = pick(s.plan, i, dev, s.forced_rows())
            qs[j], ks[j], vs[j] = s.keep_rows(rows, qs[j], ks[j], vs[j])
    for s, kj, vj in zip(states, ks, vs):
        s.store(layer, kj, vj)
    if attention == "padded":
        attn = _batched_attention(runner, states, layer, qs)
    else:   # each member's own attention kernel over its own cache, as its serial step
        attn = []
        for s, qj in zip(states, qs):
            kc, vc = s.cache.layer_kv(layer, s.plan.T)
            attn.append(runner.attend(qj, s.active, kc, vc, mask=s.mask_kind, all_rows=s.all_rows(layer)))
    sizes = [a.shape[0] for a in attn]
    h = runner.finish_layer(layer, torch.cat([s.h for s in states]), torch.cat(attn))
    for s, hj in zip(states, h.split(sizes)):
        s.h = hj
        s.layer += 1


AfterLayer = Callable[[str, int], None]


@torch.no_grad()
def blend_group(runner: LayerRunner, members: Sequence[Member], config: RepairConfig = RepairConfig(), *,
                batched: bool = False, restore: LayerwiseRestore | None = None,
                after_layer: AfterLayer | None = None, plans: Mapping[str, BlendPlan] | None = None,
                attention: str = "member") -> GroupResult:
    """Prefill every member layer-major (see module doc). `restore` (batched only) writes each layer's
    restored inputs right before that layer runs; `attention` (batched only): "member" or "padded" (module doc);
    `after_layer(name, layer)` runs after each member's layer
    (write-back of the finished layer, fault injection) and may raise MemberFailure to drop that member.
    `plans` (by member name) are the members' blend plans made beforehand: planning reads the host-side
    restored mask and copies it to the device, which a CUDA graph capture cannot contain."""
    if not members:
        raise ModelError("an empty group")
    names = [m.name for m in members]
    if len(set(names)) != len(names):
        raise ModelError(f"group member names must be unique, got {names}")
    if batched and any(m.arm not in ("repair", "full") for m in members):
        raise ModelError("batched group math covers the repair and full arms (position masks only)")
    if attention not in ("member", "padded"):
        raise ModelError(f"attention must be 'member' or 'padded', got {attention!r}")
    if restore is not None and not batched:
        raise ModelError("a layer-wise group restore belongs to the batched path")
    if plans is not None and set(plans) != set(names):
        raise ModelError(f"plans for {sorted(plans)}, members {sorted(names)}")
    states = {m.name: BlendState(runner, m.ids, m.cache,
                                 plans[m.name] if plans is not None else
                                 plan(m.arm, m.restored, config, runner.num_layers, runner.device, m.chunks))
              for m in members}
    out = GroupResult()
    for layer in range(runner.num_layers):
        live = [n for n in names if n not in out.failed]
        if not live:
            break
        if restore is not None:
            restore.layer(layer)
        if batched:
            _batched_step(runner, [states[n] for n in live], attention)
        else:
            for n in live:
                states[n].step()
        for n in live:
            out.order.append((layer, n))
            if after_layer is None:
                continue
            try:
                after_layer(n, layer)
            except MemberFailure as e:
                out.failed[n] = (layer, f"{type(e).__name__}: {e}")
                del states[n]   # its restored and partial state is the caller's to discard
    for n in names:
        if n not in out.failed:
            out.results[n] = states[n].result()
    return out
