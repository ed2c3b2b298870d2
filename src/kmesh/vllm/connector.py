"""KMeshConnector: the pinned vLLM engine (0.32, V1 connector API) served by the KMesh cache service.

    LLM(model, enforce_eager=True, kv_transfer_config={
        "kv_connector": "KMeshConnector", "kv_connector_module_path": "kmesh.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"socket": "/run/user/1000/kmesh/kmesh.sock"}})

Scheduler side (engine-core process): for each new request, how many leading prompt tokens KMesh supplies.
  prefix    full blocks whose chain key has a committed record (kmesh.kv.keys, kmesh.kv.record) — exact reuse;
  interior  the request names shared segments (kv_transfer_params {"kmesh_segments": [[a, b], ...]}); the span
            up to the end of the last one found is claimed and repaired (kmesh.kv.repair).
  Lookups read only the 256-byte records. The count and what was loaded come back to the caller in the
  request output's kv_transfer_params["kmesh"], with the engine's request id (req_id: what the worker's repair
  records carry, so a caller matches them to its outputs). Prefix blocks already stored or planned are not saved again
  (kmesh.vllm.recent: an LRU of `saved_keys` keys, default 16384; a key whose record a lookup misses is
  forgotten, so an evicted block is saved again).
Worker side: detects the engine's arrangement from the caches vLLM registers (kmesh.vllm.arrangement; a clear
  ArrangementError for one it does not understand), registers windows in that geometry with the service
  (kmesh.kv.link, the one link every KMesh process uses), and loads payloads with kmesh.kv's load step — the
  harness's children run the same one (kmesh.vllm.loads): each payload's size and digest checked against its
  record, the verified ones restored into the request's blocks (a failed block is reported through
  get_block_ids_with_load_errors: vLLM recomputes from it, with kv_load_failure_policy="recompute").
  save_kv_layer copies each layer of the blocks to save into the save window; wait_for_save stores payload, then
  record. shutdown closes every registration.
Service down: no crash, one warning, the engine computes everything.
CPU ISA refused: where vLLM's CPU attention backend packs the caches for an ISA KMesh does not address ("amx":
  a bfloat16 model on a CPU with AMX tiles; kmesh.vllm.arrangement), both sides know it from the start (vLLM's
  own _get_attn_isa over the engine's model dtype, block size, head size and cache dtype): the connector never
  contacts the service, supplies and saves nothing, every report names the refusal, one warning per process.
Negative control (the vllm stage's control engine only): kv_connector_extra_config {"negative_control":
  "skip_write"} makes a connector that lies — it plans, loads, verifies and repairs as usual and reports the
  tokens as supplied, but never writes them into the engine's blocks; it saves nothing. Every request's report
  and describe() name it, and the engine's log warns at start. Any other value is refused (ConnectorConfigError).

Requirements: the worker runs in the engine-core process or receives the metadata by pickle (both work: plans
are plain data); enable_prefix_caching may stay on (loads start after the locally cached blocks); prompts must
be prefilled in one step to be saved (chunked prefill of a longer prompt saves nothing).
"""
from __future__ import annotations

import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole

from kmesh.errors import ConfigError
from kmesh.kv.errors import LinkUnavailable, SegmentSaveError
from kmesh.kv.keys import is_segment_key, namespace, prefix_keys, record_key, segment_key, token_digest
from kmesh.kv.link import ServiceLink, shared_link
from kmesh.kv.load import Destination
from kmesh.kv.record import KIND_PREFIX, KIND_SEGMENT, RECORD_BYTES, Record
from kmesh.kv.restore import capture, restore
from kmesh.kv.rope import RopeConfig
from kmesh.sources.digest import sha256_tensor
from kmesh.vllm import arrangement as arr
from kmesh.vllm import loads
from kmesh.vllm.controls import NEGATIVE_CONTROL, NEGATIVE_CONTROL_FAULTS
from kmesh.vllm.plans import Item, LoadPlan, SavePlan, parse_spans, slots_of
from kmesh.vllm.recent import RecentKeys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kmesh.vllm")


@dataclass
class KMeshMetadata(KVConnectorMetadata):
    """One step's plans, handed from the scheduler side to the worker side."""

    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)



class ConnectorConfigError(ConfigError):
    """kv_connector_extra_config holds a value the connector refuses."""


def negative_control_of(extra: dict[str, Any]) -> str | None:
    """The negative-control fault `extra` asks for (None: a normal connector); unknown values refused."""
    fault = extra.get(NEGATIVE_CONTROL)
    if fault is not None and fault not in NEGATIVE_CONTROL_FAULTS:
        raise ConnectorConfigError(f"kv_connector_extra_config {NEGATIVE_CONTROL!r} must be one of "
                                   f"{NEGATIVE_CONTROL_FAULTS} or absent, got {fault!r}")
    return fault


_REFUSALS_WARNED: set[str] = set()      # one warning per refusal and process (scheduler and worker share one)


def engine_cpu_isa(vllm_config: "VllmConfig") -> tuple[str | None, str]:
    """(ISA vLLM's CPU attention backend will pack this engine's caches for, the settings that chose it).

    The ISA is vLLM's own `_get_attn_isa` over the engine's model dtype, block size, head size and cache dtype —
    what the CPU metadata builder computes and sets on every layer. None off the CPU platform, for MLA models
    (another backend) and where vLLM refuses the settings itself (it does so when its backend starts)."""
    from vllm.platforms import current_platform

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if not current_platform.is_cpu() or getattr(mc, "use_mla", False):
        return None, ""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    head_size = mc.get_head_size()
    detail = (f" (model dtype {mc.dtype}, block size {cc.block_size}, head size {head_size}, "
              f"kv cache dtype {cc.cache_dtype})")
    try:
        return _get_attn_isa(mc.dtype, int(cc.block_size), head_size, cc.cache_dtype), detail
    except NotImplementedError:
        return None, detail


def _warn_refused(reason: str) -> None:
    if reason not in _REFUSALS_WARNED:
        _REFUSALS_WARNED.add(reason)
        log.warning("kmesh: connector off: %s; vLLM computes every token itself", reason)


class KMeshConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.extra = extra
        self.negative_control = negative_control_of(extra)
        if self.negative_control is not None:
            log.warning("kmesh: NEGATIVE CONTROL %r: loaded K/V is not written into the engine's blocks, tokens "
                        "are still reported as supplied, nothing is saved: outputs are wrong by design",
                        self.negative_control)
        mc = vllm_config.model_config
        self.block_size = int(vllm_config.cache_config.block_size)
        self.ns = namespace(str(extra.get("namespace", mc.model)),
                            f"{mc.dtype}/{vllm_config.cache_config.cache_dtype}/{self.block_size}")
        # a control engine's blocks hold wrong K/V by design: nothing of it may reach the store
        self.save_prefix = bool(extra.get("save_prefix", True)) and self.negative_control is None
        self.staging_blocks = int(extra.get("staging_blocks", 4))
        self.records = int(extra.get("records", 64))
        # the CPU backend's ISA: an engine whose caches KMesh cannot address gets a connector that does nothing
        self.cpu_isa, self._isa_detail = engine_cpu_isa(vllm_config)
        self.refused: str | None = None
        if self.cpu_isa is not None:
            try:
                arr.check_cpu_isa(self.cpu_isa, self._isa_detail)
            except arr.UnsupportedCpuIsaError as e:
                self.refused = str(e)
                _warn_refused(self.refused)
        socket = extra.get("socket")
        if self.refused is not None:
            self.link = ServiceLink.off()
        elif socket:
            self.link = shared_link(str(socket), float(extra.get("timeout_s", 30.0)), float(extra.get("retry_s", 5.0)))
        else:
            self.link = ServiceLink.off()
            log.warning("kmesh: kv_connector_extra_config has no 'socket'; KMesh supplies nothing")
        self.stats: dict[str, Any] = {"pid": os.getpid(), "loaded_blocks": 0, "load_errors": 0, "saved": 0,
                                      "save_skipped": 0, "repairs": [], "seconds": {}}
        self.engine: arr.EngineCache | None = None
        # scheduler state
        self._plans: dict[str, LoadPlan] = {}
        self._reports: dict[str, dict[str, Any]] = {}
        # prefix keys stored or planned: spares a save, bounded (a forgotten key costs one refused save)
        self._saved_keys = RecentKeys(int(extra.get("saved_keys", 16384)))
        self._link_session = 0           # the link session _saved_keys belongs to
        # worker state
        self._load_errors: set[int] = set()
        self._save_slots: list[tuple[Item, torch.Tensor, int, torch.Tensor]] = []
        self._save_meta: Any = None
        self._failed_reqs: set[str] = set()
        self._runner: Any = None

    # ==================================================================================================
    # shared
    @contextmanager
    def _timed(self, part: str):
        """Accumulated wall time per part (lookup, fetch, verify, restore, repair, save) for the stage's table."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sec = self.stats["seconds"]
            sec[part] = sec.get(part, 0.0) + time.perf_counter() - t0

    def _window(self, name: str) -> Any:
        """This link session's window (registered on first use, and again after a reconnect)."""
        if name == "records":
            return self.link.window(name, arr.record_layout(self.records), alloc_id=id(self.link))
        if self.engine is None:
            raise LinkUnavailable("no engine KV cache registered in this process")
        # the engine cache's address names the allocation these windows serve (+ window number)
        return self.link.window(name, arr.staging_layout(self.engine.layout, self.staging_blocks),
                                alloc_id=self.engine.raw.data_ptr() + (name == "save"))

    def _read_record(self, key: bytes) -> Record | None:
        """The committed record of payload `key`, or None (missing / not ours)."""
        return loads.read_record(self.link, self._window("records"), key)

    def _part(self, name: str) -> Any:
        """The load step's parts under the connector's names (stage = fetch + verify; fetch = the service's copies)."""
        return self._timed({"load": "fetch"}.get(name, name))

    def describe(self) -> dict[str, Any]:
        """Counters + the link's state (for the stage and tests, through the engine process)."""
        return {**self.stats, "namespace": self.ns.decode(), "block_size": self.block_size,
                "negative_control": self.negative_control, "cpu_isa": self.cpu_isa, "refused": self.refused,
                "link": {"up": self.link.up, "warnings": self.link.warnings, "sessions": self.link.sessions,
                         "down_reason": self.link.down_reason, "closed": self.link.closed,
                         "registrations": {n: [w.ref.reg, w.ref.gen] for n, w in self.link.windows.items()}}}

    def shutdown(self) -> None:
        """Engine exit: every registration of this process closes (the service drains, then releases it)."""
        self.link.close()

    # ==================================================================================================
    # scheduler side
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        prompt = list(request.prompt_token_ids or [])
        params = request.kv_transfer_params or {}
        self._reports[request.request_id] = self._new_report(request.request_id)
        if self.refused is not None:
            return 0, False
        if not self.link.connect():
            self._reports[request.request_id]["service"] = "down"
            return 0, False
        session = getattr(self.link, "sessions", 0)
        if session != self._link_session:      # connected anew: what the old connection saved may be gone
            self._saved_keys.clear()
            self._link_session = session
        try:
            with self._timed("lookup"):
                if "kmesh_segments" in params:
                    plan = self._interior_plan(request.request_id, prompt, params["kmesh_segments"],
                                               num_computed_tokens)
                else:
                    plan = self._prefix_plan(request.request_id, prompt, num_computed_tokens)
        except LinkUnavailable:
            self._reports[request.request_id]["service"] = "down"
            return 0, False
        if plan is None or plan.num_tokens <= num_computed_tokens:
            self._plans.pop(request.request_id, None)
            return 0, False
        self._plans[request.request_id] = plan
        return plan.num_tokens - num_computed_tokens, False

    def _new_report(self, req_id: str) -> dict[str, Any]:
        """What the request's output carries in kv_transfer_params["kmesh"]: req_id is the engine's request id
        (the one the worker's repair records carry), negative_control the fault of a control engine."""
        report = {"req_id": req_id, "tokens_supplied": 0, "mode": "none", "load_errors": 0, "service": "up"}
        if self.refused is not None:
            report.update(service="not contacted", refused=self.refused)
        if self.negative_control is not None:
            report["negative_control"] = self.negative_control
        return report

    def _prefix_plan(self, req_id: str, prompt: list[int], computed: int) -> LoadPlan | None:
        bs = self.block_size
        # every whole block of the prompt that is stored, the last one too: the engine must compute at least the last
        # prompt token, so a prompt of whole blocks is supplied up to that token and its last block loaded partly
        blocks = len(prompt) // bs
        items = []
        for i, key in enumerate(prefix_keys(self.ns, prompt, bs, blocks)):
            toks = tuple(prompt[i * bs:(i + 1) * bs])
            rec = self._read_record(key)
            if rec is None:
                # not stored (evicted, its save never happened, the service restarted): save it again, and every
                # later block of the prompt too (the chain is cut here; what follows may be gone as well)
                for later in prefix_keys(self.ns, prompt, bs, len(prompt) // bs)[i:]:
                    self._saved_keys.discard(later)
                break
            if not rec.matches(KIND_PREFIX, toks, i * bs):
                break
            items.append(Item(key, rec, i * bs, toks))
        self._saved_keys.add(it.key for it in items)
        if not items:
            return None
        first = computed // bs
        return LoadPlan(req_id, "prefix", min(len(items) * bs, len(prompt) - 1), first * bs, items[first:])

    def _interior_plan(self, req_id: str, prompt: list[int], raw: Any, computed: int) -> LoadPlan | None:
        spans = parse_spans(raw, len(prompt))
        if spans is None:
            log.warning("kmesh: request %s: kmesh_segments %r are not sorted disjoint [start, end) spans inside "
                        "the %d-token prompt; ignored", req_id, str(raw)[:80], len(prompt))
            return None
        if computed:   # a local prefix hit already fixed the first positions; the repair needs the whole span
            return None
        items = []
        for a, b in spans:
            toks = tuple(prompt[a:b])
            key = segment_key(self.ns, toks)
            rec = self._read_record(key)
            if rec is not None and rec.matches(KIND_SEGMENT, toks, None):
                items.append(Item(key, rec, a, toks))
        if not items:
            return None
        end = min(items[-1].start + len(items[-1].tokens), len(prompt) - 1)
        return LoadPlan(req_id, "interior", end, 0, items, span=tuple(prompt[:end]))

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            self._plans.pop(request.request_id, None)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KMeshMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            block_ids = list(new.block_ids[0])
            plan = self._plans.pop(new.req_id, None)
            report = self._reports.setdefault(new.req_id, self._new_report(new.req_id))
            if plan is not None:
                plan.block_ids = block_ids
                meta.loads.append(plan)
                report.update(tokens_supplied=plan.num_tokens - plan.first, mode=plan.mode,
                              segments=len(plan.items) if plan.mode == "interior" else None,
                              stored_tokens=sum(len(it.tokens) for it in plan.items),
                              block_ids=block_ids)
            save = self._save_plan(new, scheduler_output.num_scheduled_tokens.get(new.req_id, 0))
            if save is not None:
                save.block_ids = block_ids
                meta.saves.append(save)
                report["saving"] = len(save.items)
        return meta

    def _save_plan(self, new: Any, scheduled: int) -> SavePlan | None:
        if self.refused is not None or not self.link.up:
            return None
        prompt = list(new.prompt_token_ids or [])
        if new.num_computed_tokens + scheduled < len(prompt):
            return None          # chunked prefill: not every prompt block is written in this step
        sp = new.sampling_params
        params = ((sp.extra_args or {}).get("kv_transfer_params") if sp is not None else None) or {}
        items: list[Item] = []
        if self.negative_control is not None:
            return None               # this engine's blocks hold wrong K/V by design: never stored
        if "kmesh_save_segments" in params:
            spans = parse_spans(params["kmesh_save_segments"], len(prompt))
            if spans is None:
                log.warning("kmesh: request %s: kmesh_save_segments malformed; nothing saved", new.req_id)
            for a, b in spans or ():
                toks = tuple(prompt[a:b])
                items.append(Item(segment_key(self.ns, toks), None, a, toks))
        elif self.save_prefix:
            bs = self.block_size
            for i, key in enumerate(prefix_keys(self.ns, prompt, bs, len(prompt) // bs)):
                if not self._saved_keys.touch(key):
                    items.append(Item(key, None, i * bs, tuple(prompt[i * bs:(i + 1) * bs])))
            self._saved_keys.add(it.key for it in items)
        return SavePlan(new.req_id, items) if items else None

    def update_connector_output(self, connector_output: Any) -> None:
        bad = set(getattr(connector_output, "invalid_block_ids", None) or ())
        if not bad:
            return
        for rep in self._reports.values():
            ids = rep.get("block_ids") or []
            hit = [i for i, b in enumerate(ids) if b in bad]
            if hit and rep["tokens_supplied"]:
                # vLLM recomputes from the first failed block: only the blocks before it were supplied
                rep["load_errors"] += len(hit)
                rep["tokens_supplied"] = max(0, min(rep["tokens_supplied"], hit[0] * self.block_size))

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._plans.pop(request.request_id, None)
        rep = self._reports.pop(request.request_id, None)
        if rep is None:
            return False, None
        rep.pop("block_ids", None)
        return False, {"kmesh": rep}

    # ==================================================================================================
    # worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.refused is not None:
            return
        vc = self._vllm_config
        mc, pc = vc.model_config, vc.parallel_config
        layers = vc.compilation_config.static_forward_context
        try:
            self.engine = arr.detect(kv_caches, layers, mc.get_num_kv_heads(pc), mc.get_head_size(),
                                     mc.get_num_layers(pc), self.cpu_isa, self._isa_detail)
        except arr.UnsupportedCpuIsaError as e:
            # the layers' ISA, where engine_cpu_isa could not tell it: no engine, no windows — a load the
            # scheduler side plans fails its blocks (vLLM recomputes them) and nothing is saved
            self.refused = str(e)
            _warn_refused(self.refused)
            return
        self.rope = RopeConfig.from_hf_config(mc.hf_text_config)
        self._block_bytes = arr.staging_layout(self.engine.layout, 1).nbytes
        self.stats.update(layout=self.engine.layout.to_dict(), backend=self.engine.backend,
                          engine_address=self.engine.raw.data_ptr())
        try:
            for name in ("load", "save", "records"):
                self._window(name)
        except LinkUnavailable:
            return
        self.stats["registrations"] = [w.ref.reg for w in self.link.windows.values()]

    # -- loads ---------------------------------------------------------------------------------------------
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KMeshMetadata)
        self._failed_reqs = set()
        for plan in meta.loads:
            try:
                if plan.mode == "prefix":
                    self._load_prefix(plan)
                else:
                    self._load_interior(plan)
            except LinkUnavailable:
                self._fail_blocks(plan, plan.first)

    def _fail_blocks(self, plan: LoadPlan, from_position: int) -> None:
        bs = self.block_size
        self._failed_reqs.add(plan.req_id)       # this step's KV of the request is not trusted: no save
        ids = plan.block_ids[from_position // bs:math.ceil(plan.num_tokens / bs)]
        self._load_errors.update(ids)
        self.stats["load_errors"] += len(ids)

    def _scratch(self, num_tokens: int) -> Destination:
        """Where the negative control "skip_write" restores instead of the engine's blocks (slot = position)."""
        span = loads.new_span(self.engine.layout, num_tokens)
        return Destination(span.raw, span.layout, self.rope)

    def _load_prefix(self, plan: LoadPlan) -> None:
        """Blocks in window-sized chunks, each one load step (kmesh.vllm.loads.load_prefix). A block that fails ends
        the plan there: the verified blocks before it are restored, the rest reported."""
        if not plan.items:
            return
        dest = (loads.engine_destination(self.engine.raw, self.engine.layout, self.rope, plan.block_ids)
                if self._writes_engine() else self._scratch(plan.num_tokens))
        bad = loads.load_prefix(self.link, self._window("load"), plan.items, plan.num_tokens, dest, self._part)
        end = plan.items[-1].start + self.block_size if bad is None else bad
        self.stats["loaded_blocks"] += (end - plan.items[0].start) // self.block_size
        if bad is not None:
            self._fail_blocks(plan, bad)

    def _load_interior(self, plan: LoadPlan) -> None:
        from kmesh.kv.repair import kv_digest, repair_span, write_span

        span = loads.load_span(self.link, self._window("load"), plan.items, plan.num_tokens, self.engine.layout,
                               self.rope, self._part)
        if not self.link.up:      # the service went away during the loads: vLLM computes the request itself
            raise LinkUnavailable(self.link.down_reason or "cache service lost")
        runner = self._repair_runner()
        with self._timed("repair"):
            rep = repair_span(runner, plan.span, span.raw, span.layout, span.restored, self._repair_config())
        pos = torch.arange(plan.num_tokens)
        if self._writes_engine():
            with self._timed("write"):
                write_span(self.engine.raw, self.engine.layout, rep.segment,
                           slots_of(plan.block_ids, pos, self.block_size), self.rope)
        with self._timed("record"):
            self.stats["repairs"].append({"req_id": plan.req_id, "span": plan.num_tokens,
                                          "segments": span.loaded, "segments_not_loaded": len(span.missing),
                                          "recomputed": rep.recomputed, "kv_sha256": kv_digest(rep.segment),
                                          "logits": rep.logits.float().clone()})

    def _writes_engine(self) -> bool:
        """False only in the negative control "skip_write": the engine's blocks keep whatever they held."""
        if self.negative_control == "skip_write":
            self.stats["writes_skipped"] = self.stats.get("writes_skipped", 0) + 1
            return False
        return True

    def _repair_runner(self) -> Any:
        if self._runner is None:
            from kmesh.vllm.repair_model import load_runner

            self._runner = load_runner(self.extra.get("repair_model") or self._vllm_config.model_config.model)
        return self._runner

    def _repair_config(self) -> Any:
        from kmesh.model.blend import RepairConfig

        return RepairConfig.from_dict(self.extra.get("repair") or {})

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None      # loads complete inside start_load_kv (synchronous)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    # -- saves ---------------------------------------------------------------------------------------------
    def _assign_saves(self, meta: KMeshMetadata) -> None:
        """Window places for this step's saves: (item, engine slots, window offset in blocks, positions)."""
        self._save_slots = []
        if not meta.saves or not self.link.connect():
            return
        try:
            w = self._window("save")
        except LinkUnavailable:
            return
        used = 0
        for plan in meta.saves:
            if plan.req_id in self._failed_reqs:
                continue
            for it in plan.items:
                nblocks = math.ceil(len(it.tokens) / self.block_size)
                if used + nblocks > self.staging_blocks:
                    self.stats["save_skipped"] += 1
                    continue
                pos = torch.arange(it.start, it.start + len(it.tokens))
                # zeroed first: a partial last block saves defined bytes, never an earlier save's tail
                w.tensor[used * self._block_bytes:(used + nblocks) * self._block_bytes].zero_()
                self._save_slots.append((it, slots_of(plan.block_ids, pos, self.block_size), used, pos))
                used += nblocks

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._save_meta is not meta:    # first layer of this step (vLLM may start loads after the forward)
            self._save_meta = meta
            self._assign_saves(meta)
        if not self._save_slots:
            return
        layer = self.engine.layer_names.index(layer_name)
        w = self.link.windows.get("save")
        if w is None:
            self._save_slots = []
            return
        for it, slots, at, pos in self._save_slots:
            seg = capture(self.engine.raw, self.engine.layout, slots, pos, layers=[layer])
            dst = at * self.block_size + torch.arange(len(it.tokens))
            restore(w.tensor, w.layout, seg, dst, pos, self.rope, first_layer=layer)

    def wait_for_save(self) -> None:
        with self._timed("save"):
            self._store_saves()

    def _store_saves(self) -> None:
        try:
            self._store_saves_now()
        finally:                        # this step's assignment is spent, saved or not
            self._save_slots = []
            self._save_meta = None

    def _store_saves_now(self) -> None:
        w = self.link.windows.get("save")
        if w is None:
            return
        for it, _slots, at, _pos in self._save_slots:
            nblocks = math.ceil(len(it.tokens) / self.block_size)
            off, n = at * self._block_bytes, nblocks * self._block_bytes
            rec = Record(KIND_SEGMENT if is_segment_key(it.key) else KIND_PREFIX, len(it.tokens), it.start,
                         n, bytes.fromhex(sha256_tensor(w.tensor[off:off + n])), token_digest(it.tokens))
            try:
                if not self.link.save(w.ref, it.key, off, n):
                    continue                          # already stored by someone: their record follows theirs
                rw = self._window("records")
                rw.tensor[:RECORD_BYTES].copy_(torch.frombuffer(bytearray(rec.pack()), dtype=torch.uint8))
                self.link.save(rw.ref, record_key(it.key), 0, RECORD_BYTES)
                self.stats["saved"] += 1
            except (LinkUnavailable, SegmentSaveError) as e:
                log.warning("kmesh: saving %r failed: %s", it.key, e)
                return

