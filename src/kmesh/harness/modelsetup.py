"""The one setup of a model stage: model + tokenizer, layer-wise runner, workload, the leader's export and the
context every child runs in. Shared by the stages that run children (equivalence, storage, group) and by the
diagnostics, so none of them reaches into another stage for it.

    res, setup = begin_with_setup("storage", cfg, lambda cfg: build_setup(cfg, SetupSpec(...)))
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch

from kmesh.config import Config
from kmesh.harness.child import ChildContext
from kmesh.harness.leader import Export, export_segments
from kmesh.harness.workload import ByteTokenizer, HFTokenizer, Workload, WorkloadSpec, build
from kmesh.model import qwen2_random, smollm2
from kmesh.model.blend import RepairConfig
from kmesh.model.runner import LayerRunner
from kmesh.result import Result
from kmesh.transfer.engine import TransferEngine


@dataclass
class ModelSetup:
    """What a model stage's cases run on (`sec` is the stage's own config section)."""

    cfg: Config
    sec: dict[str, Any]
    device: torch.device
    model: Any
    what: str                    # which model this is, for the result file
    tok: Any
    runner: LayerRunner
    workload: Workload
    export: Export
    ctx: ChildContext

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    @property
    def arrival_digest(self) -> str:
        """What this setup's children check segments with on arrival: every export of the stage records it."""
        return self.export.catalog.entries[0].arrival_algorithm if self.export.catalog.entries else "sha256"

    def export_leader(self, workload: Workload, key_prefix: bytes) -> Export:
        """Another workload's leader prefilled and exported like this setup's own (same arrival digest)."""
        return leader_prefill(self.runner, workload, key_prefix, self.arrival_digest)


@dataclass(frozen=True)
class SetupSpec:
    """How one stage builds its ModelSetup: which section it reads, and the settings it takes from where."""

    section: str                       # the stage's config section (becomes ModelSetup.sec)
    key_prefix: bytes                  # the leader's object keys
    model_sec: dict[str, Any]          # `model`, `byte_token_offset` (the equivalence section's keys)
    workload: dict[str, Any]           # WorkloadSpec fields
    repair: dict[str, Any]             # RepairConfig of the children
    max_new_tokens: int
    restore_backend: str = "torch"
    attention: str = "auto"
    device: str = "cpu"
    arrival_digest: str = "sha256"     # what children check each segment with on arrival (kmesh.kv.digests)
    stop_at_end_of_turn: bool = False  # children's continuations end at the model's end-of-turn token


def deterministic_kernels() -> dict[str, Any]:
    """Bit-for-bit comparisons need kernels that are run-to-run deterministic. cuBLAS is not when several
    streams share its workspace (the transfer engine copies on a side stream): a decode-step GEMV then
    differed in one bf16 ulp between two runs of one prompt. Must run before the first CUDA call."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    return {"CUBLAS_WORKSPACE_CONFIG": os.environ["CUBLAS_WORKSPACE_CONFIG"],
            "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}


def load_model(cfg: Config, model_sec: dict[str, Any], device: torch.device) -> tuple[Any, Any, str]:
    """(model, tokenizer adapter, what it is) for model_sec["model"] = smollm2 | qwen2_random."""
    if model_sec["model"] == "smollm2":
        folder = smollm2.converted_dir(cfg)
        model, tok = smollm2.load_converted(folder)
        # the folder is float32 (the conversion's checks are bit for bit); a GPU runs it as served: bf16
        dtype = str(cfg.section("model")["smollm2"].get("run_dtype", "float32"))
        model = model.to(device=device, dtype=getattr(torch, dtype))
        return model, HFTokenizer(tok), f"smollm2:{folder}:{dtype}"
    qsec = cfg.section("model")["qwen2_random"]
    model, what = qwen2_random.load(qsec, cfg.seed, device, root=cfg.root)
    return model, ByteTokenizer(model.config.vocab_size, offset=int(model_sec.get("byte_token_offset", 0))), what


def end_of_turn_ids(model: Any, tok: Any) -> tuple[int, ...]:
    """The token ids that end a turn: the tokenizer's eos and the generation config's eos (what transformers'
    generate stops on; SmolLM2-Instruct: <|im_end|>). The byte tokenizer of random weights has none: ()."""
    if isinstance(tok, ByteTokenizer):
        return ()
    ids: set[int] = set()
    eos = getattr(tok.tok, "eos_token_id", None)
    gen = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for x in (eos, gen):
        if isinstance(x, int):
            ids.add(x)
        elif isinstance(x, (list, tuple)):
            ids.update(int(i) for i in x)
    return tuple(sorted(ids))


def leader_prefill(runner: LayerRunner, workload: Workload, key_prefix: bytes, arrival: str = "sha256") -> Export:
    """The leader's prompt prefilled once and exported as one object per shared segment."""
    ids = torch.tensor(workload.leader_ids, device=runner.device)
    cache = runner.new_cache(len(ids), workload.spec.block_size)
    runner.prefill(ids, cache)
    return export_segments(runner, cache, workload, key_prefix, arrival)


def build_setup(cfg: Config, spec: SetupSpec) -> ModelSetup:
    device = torch.device(spec.device)
    model, tok, what = load_model(cfg, spec.model_sec, device)
    # the model section's layer step for every stage that runs this model (both arms of every comparison alike)
    runner = LayerRunner(model, spec.attention, str(spec.model_sec.get("layer_step", "eager")))
    workload = build(tok, cfg.seed, WorkloadSpec(**spec.workload))
    export = leader_prefill(runner, workload, spec.key_prefix, spec.arrival_digest)
    ctx = ChildContext(runner, export.catalog, TransferEngine(str(device)), RepairConfig.from_dict(spec.repair),
                       int(spec.max_new_tokens), spec.restore_backend,
                       end_of_turn_ids(model, tok) if spec.stop_at_end_of_turn else ())
    return ModelSetup(cfg, cfg.section(spec.section), device, model, what, tok, runner, workload, export, ctx)


def equivalence_setup(cfg: Config) -> ModelSetup:
    """The equivalence stage's setup, from cfg.section("equivalence"): its model, workload, repair and leader
    (object keys under b"kmesh-eq/leader"). The diagnostics measure on exactly what that stage runs."""
    sec = cfg.section("equivalence")
    return build_setup(cfg, SetupSpec(
        section="equivalence", key_prefix=b"kmesh-eq/leader", model_sec=sec, workload=sec.get("workload", {}),
        repair=sec["repair"], max_new_tokens=int(sec["max_new_tokens"]),
        restore_backend=sec.get("restore_backend", "torch"), attention=sec.get("attention", "auto"),
        device=sec["device"], stop_at_end_of_turn=True, arrival_digest=sec.get("arrival_digest", "sha256")))


SetupT = TypeVar("SetupT", bound=ModelSetup)


def begin_with_setup(stage: str, cfg: Config, make: Callable[[Config], SetupT],
                     model: str | None = None) -> tuple[Result, SetupT | None]:
    """A model stage's result with determinism recorded and its `setup` case run (model, workload, leader export
    by `make`); the setup is None when that case failed (the result then says why). `model` names the model in the
    case's params (default: the equivalence section's)."""
    res = Result.begin(stage, cfg)
    res.extra["determinism"] = deterministic_kernels()
    made: list[SetupT] = []
    with res.case("setup", {"model": model or cfg.section("equivalence")["model"]}) as case:
        made.append(make(cfg))
        case.check("leader_exported", len(made[0].export.catalog.entries) == len(made[0].workload.segments))
    return res, (made[0] if made else None)
