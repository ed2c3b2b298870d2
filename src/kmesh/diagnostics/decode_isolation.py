"""Which decode-step op makes greedy decode of the equivalence workload differ between runs (GPU)?

Runs the full prefill + 23 decode steps of child C `--runs` + 4 times in one process: two on a quiet GPU, `--runs`
while a background loop starts and ends other processes' CUDA contexts (the trigger seen before), two after.
Every decode step records each op's output per layer (embed, qkv, attention, o_proj + residual, MLP + residual,
logits). For every run that differs from run 0 it finds the first (step, layer, op) whose output differs; for an
attention op it checks whether that op's inputs were equal, re-runs it on the saved inputs 20 times and once per
SDPA backend forced.

Output (JSON, --out; one line per run printed as well): runs, churn_contexts (contexts the loop started) and per
run: tokens_equal, prefill_equal, first_diff [step, layer, op] (null: bit-identical to run 0), max_abs there.
For a first_diff on attn: attn_inputs_equal (true = the kernel itself is not reproducible), rerun_matches_this /
rerun_matches_run0 (of 20 re-runs on the same inputs), backend_<name>_eq_this / _eq_run0 per SDPA backend (which
backend reproduces which result). For any other op: previous_op and previous_op_equal (its input).
docs/measurements/equivalence-h200/README.md reads one such file.
"""
from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from kmesh.diagnostics._common import load, parser, require_cuda, write_json
from kmesh.harness.child import new_cache
from kmesh.harness.modelsetup import ModelSetup, deterministic_kernels, equivalence_setup
from kmesh.model.blend import blend

STEPS = 23
CHILD = 2          # child C: the one whose decode was seen to differ
BACKENDS = (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
            ("math", SDPBackend.MATH), ("cudnn", SDPBackend.CUDNN_ATTENTION))
# A process that opens a CUDA context, does one kernel and ends: what the churn loop starts over and over.
CONTEXT_PROCESS = "import torch; x=torch.ones(1<<20, device='cuda'); (x*2).sum().item()"

Record = dict[Any, Any]   # (step, layer, op) -> output; "prefill_logits"; (step, layer, "_inputs") -> (q, k, v)


@torch.no_grad()
def recorded_run(setup: ModelSetup) -> tuple[list[int], Record]:
    """Prefill + STEPS greedy decode steps of the child, every op's output kept: (tokens, record)."""
    runner = setup.runner
    child = setup.workload.children[CHILD]
    ids = torch.tensor(child.ids, device=setup.device)
    prompt_len = len(ids)
    cache = new_cache(setup.ctx, child)
    first = blend(runner, ids, cache, torch.zeros(prompt_len, dtype=torch.bool), setup.ctx.repair, "full")
    tokens, rec = [int(first.logits.argmax())], {"prefill_logits": first.logits.clone()}
    for step in range(STEPS):
        pos = torch.tensor([prompt_len + step], device=setup.device)
        hidden = runner.embed(torch.tensor([tokens[-1]], device=setup.device))
        rot = runner.rotary(pos)
        rec[(step, -1, "embed")] = hidden.clone()
        for layer in range(runner.num_layers):
            q, k, v = runner.qkv(layer, hidden, pos, rot)
            rec[(step, layer, "qkv")] = torch.cat([q.flatten(), k.flatten(), v.flatten()]).clone()
            cache.write(layer, pos, k, v)
            keys, values = cache.layer_kv(layer, prompt_len + step + 1)
            attn = runner.attend(q, pos, keys, values, last_query=True)
            rec[(step, layer, "attn")] = attn.clone()
            block = runner.inner.layers[layer]
            mid = hidden + block.self_attn.o_proj(attn)
            rec[(step, layer, "o_proj")] = mid.clone()
            hidden = mid + block.mlp(block.post_attention_layernorm(mid))
            rec[(step, layer, "mlp")] = hidden.clone()
            rec[(step, layer, "_inputs")] = (q.clone(), keys.clone(), values.clone())
        step_logits = runner.logits(hidden)[0]
        rec[(step, 99, "logits")] = step_logits.clone()
        tokens.append(int(step_logits.argmax()))
    return tokens, rec


class ContextChurn:
    """While entered, a thread keeps starting short processes that each open and close a CUDA context."""

    def __init__(self) -> None:
        self.contexts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.is_set():
            subprocess.run([sys.executable, "-c", CONTEXT_PROCESS], check=False)
            self.contexts += 1

    def __enter__(self) -> "ContextChurn":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _attention_rerun(setup: ModelSetup, row: dict[str, Any], first: tuple, rec: Record, base: Record) -> None:
    """The differing attention op again on its saved inputs: 20 times as the runner runs it, once per backend."""
    step, layer, _ = first
    q, keys, values = rec[(step, layer, "_inputs")]
    q_base, keys_base, values_base = base[(step, layer, "_inputs")]
    row["attn_inputs_equal"] = bool(torch.equal(q, q_base) and torch.equal(keys, keys_base)
                                    and torch.equal(values, values_base))
    pos = torch.tensor([len(setup.workload.children[CHILD].ids) + step], device=setup.device)
    this_run, run0 = rec[first], base[first]
    reruns = [setup.runner.attend(q, pos, keys, values, last_query=True) for _ in range(20)]
    row["rerun_matches_this"] = sum(torch.equal(out, this_run) for out in reruns)
    row["rerun_matches_run0"] = sum(torch.equal(out, run0) for out in reruns)
    for name, backend in BACKENDS:
        try:
            with sdpa_kernel(backend):
                out = setup.runner.attend(q, pos, keys, values, last_query=True)
        except RuntimeError as e:   # a backend that cannot run these shapes here is recorded, not fatal
            row[f"backend_{name}"] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        row[f"backend_{name}_eq_this"] = bool(torch.equal(out, this_run))
        row[f"backend_{name}_eq_run0"] = bool(torch.equal(out, run0))


def compare_runs(setup: ModelSetup, runs: list[tuple[list[int], Record]]) -> list[dict[str, Any]]:
    """One row per run: how it compares with run 0 (see the module doc)."""
    base_tokens, base = runs[0]
    order = [key for key in base if isinstance(key, tuple) and key[2] != "_inputs"]
    rows = []
    for index, (tokens, rec) in enumerate(runs):
        row: dict[str, Any] = {"run": index, "tokens_equal": tokens == base_tokens,
                               "prefill_equal": bool(torch.equal(rec["prefill_logits"], base["prefill_logits"]))}
        first = next((key for key in order if not torch.equal(rec[key], base[key])), None)
        row["first_diff"] = list(first) if first else None
        if first:
            row["max_abs"] = float((rec[first].float() - base[first].float()).abs().max())
            if first[2] == "attn":
                _attention_rerun(setup, row, first, rec, base)
            else:
                prev = order[order.index(first) - 1]
                row["previous_op_equal"] = bool(torch.equal(rec[prev], base[prev]))
                row["previous_op"] = list(prev)
        rows.append(row)
        print(row, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    options = parser("decode_isolation", __doc__, config=True, out=True)
    options.add_argument("--runs", type=int, default=10, help="runs during the context churn (default 10)")
    args = options.parse_args(argv)
    require_cuda("decode_isolation")
    cfg = load(args)
    deterministic_kernels()
    setup = equivalence_setup(cfg)
    runs = [recorded_run(setup), recorded_run(setup)]
    with ContextChurn() as churn:
        runs += [recorded_run(setup) for _ in range(args.runs)]
    runs += [recorded_run(setup), recorded_run(setup)]
    write_json(args.out, {"runs": len(runs), "churn_contexts": churn.contexts,
                          "per_run": compare_runs(setup, runs)}, cfg)
    return 0
