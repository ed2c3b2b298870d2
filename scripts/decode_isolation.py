"""GPU: which decode-step kernel makes greedy decode of the equivalence workload differ between runs?

Runs the full prefill + 23 decode steps of child C `runs` times in one process; runs 2.. happen while a
background loop starts and ends other processes' CUDA contexts (the trigger seen before). Every decode step
records each op's output per layer (qkv, attention, o_proj+residual, MLP+residual, logits). For every run that
differs from run 0, reports the first (step, layer, op) whose output differs while its inputs were equal, then
re-runs that op on the saved inputs 20 times (unique results) and with the attention forced to each SDPA backend.
Writes JSON to argv[1].
"""
import json
import subprocess
import sys
import threading

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kmesh.child import new_cache
from kmesh.config import load_config
from kmesh.model.blend import blend
from kmesh.stages import equivalence as eq

cfg = load_config(profile="cuda")
eq.deterministic_kernels()
s = eq._setup(cfg)
r = s.runner
child = s.workload.children[2]
ids = torch.tensor(child.ids, device=s.device)
T = len(ids)
STEPS = 23


@torch.no_grad()
def run():
    cache = new_cache(s.ctx, child)
    res = blend(r, ids, cache, torch.zeros(T, dtype=torch.bool), s.ctx.repair, "full")
    toks, rec = [int(res.logits.argmax())], {"prefill_logits": res.logits.clone()}
    for i in range(STEPS):
        p = torch.tensor([T + i], device=s.device)
        h = r.embed(torch.tensor([toks[-1]], device=s.device))
        rot = r.rotary(p)
        rec[(i, -1, "embed")] = h.clone()
        for l in range(r.num_layers):
            q, k, v = r.qkv(l, h, p, rot)
            rec[(i, l, "qkv")] = torch.cat([q.flatten(), k.flatten(), v.flatten()]).clone()
            cache.write(l, p, k, v)
            kc, vc = cache.layer_kv(l, T + i + 1)
            a = r.attend(q, p, kc, vc, last_query=True)
            rec[(i, l, "attn")] = a.clone()
            blk = r.inner.layers[l]
            hm = h + blk.self_attn.o_proj(a)
            rec[(i, l, "o_proj")] = hm.clone()
            h = hm + blk.mlp(blk.post_attention_layernorm(hm))
            rec[(i, l, "mlp")] = h.clone()
            rec[(i, l, "_inputs")] = (q.clone(), kc.clone(), vc.clone())
        lg = r.logits(h)[0]
        rec[(i, 99, "logits")] = lg.clone()
        toks.append(int(lg.argmax()))
    return toks, rec


stop = threading.Event()
churn = {"contexts": 0}


def churner():
    while not stop.is_set():
        subprocess.run([sys.executable, "-c", "import torch; x=torch.ones(1<<20, device='cuda'); (x*2).sum().item()"],
                       check=False)
        churn["contexts"] += 1


runs = [run(), run()]
th = threading.Thread(target=churner, daemon=True)
th.start()
for _ in range(int(sys.argv[2]) if len(sys.argv) > 2 else 10):
    runs.append(run())
stop.set()
th.join()
runs += [run(), run()]

order = [k for k in runs[0][1] if isinstance(k, tuple) and k[2] != "_inputs"]
report = {"runs": len(runs), "churn_contexts": churn["contexts"], "per_run": []}
base_t, base = runs[0]
for j, (t, rec) in enumerate(runs):
    row = {"run": j, "tokens_equal": t == base_t,
           "prefill_equal": bool(torch.equal(rec["prefill_logits"], base["prefill_logits"]))}
    first = next((k for k in order if not torch.equal(rec[k], base[k])), None)
    row["first_diff"] = list(first) if first else None
    if first:
        row["max_abs"] = float((rec[first].float() - base[first].float()).abs().max())
        step, layer, op = first
        if op == "attn":
            q, kc, vc = rec[(step, layer, "_inputs")]
            qb, kb, vb = base[(step, layer, "_inputs")]
            row["attn_inputs_equal"] = bool(torch.equal(q, qb) and torch.equal(kc, kb) and torch.equal(vc, vb))
            outs = {"this_run": rec[first], "run0": base[first]}
            reps = [r.attend(q, torch.tensor([T + step], device=s.device), kc, vc, last_query=True) for _ in range(20)]
            row["rerun_matches_this"] = sum(torch.equal(x, outs["this_run"]) for x in reps)
            row["rerun_matches_run0"] = sum(torch.equal(x, outs["run0"]) for x in reps)
            for name, be in (("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                             ("math", SDPBackend.MATH), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
                try:
                    with sdpa_kernel(be):
                        x = r.attend(q, torch.tensor([T + step], device=s.device), kc, vc, last_query=True)
                    row[f"backend_{name}_eq_this"] = bool(torch.equal(x, outs["this_run"]))
                    row[f"backend_{name}_eq_run0"] = bool(torch.equal(x, outs["run0"]))
                except Exception as e:  # noqa: BLE001
                    row[f"backend_{name}"] = f"{type(e).__name__}: {str(e)[:160]}"
        else:
            prev = order[order.index(first) - 1]
            row["previous_op_equal"] = bool(torch.equal(rec[prev], base[prev]))
            row["previous_op"] = list(prev)
    report["per_run"].append(row)
    print(row, flush=True)
json.dump(report, open(sys.argv[1], "w"), indent=1)
