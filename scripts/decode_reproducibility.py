"""GPU repro: is greedy decode of the equivalence workload run-to-run reproducible in one process?

Seven full recomputes + 23 decode steps of child C (cuda profile): two on a quiet GPU, three while a cache-service
process (its own CUDA context) is running, two after it stopped. Prints, per run, the first generated token and the
first decode step whose logits differ from run 0. Run: source scripts/device-env.sh; python3 scripts/decode_reproducibility.py
"""
import torch
from kmesh.config import load_config
from kmesh.stages import equivalence as eq
from kmesh.child import new_cache
from kmesh.model.blend import blend
from kmesh.service.harness import Harness
cfg = load_config(profile="cuda")
eq.deterministic_kernels()
s = eq._setup(cfg)
r = s.runner
child = s.workload.children[2]
ids = torch.tensor(child.ids, device=s.device); T = len(ids)

@torch.no_grad()
def run():
    cache = new_cache(s.ctx, child)
    res = blend(r, ids, cache, torch.zeros(T, dtype=torch.bool), s.ctx.repair, "full")
    toks, steps = [int(res.logits.argmax())], [res.logits.float().cpu()]
    for i in range(23):
        p = torch.tensor([T + i], device=s.device)
        h = r.embed(torch.tensor([toks[-1]], device=s.device)); rot = r.rotary(p)
        for l in range(r.num_layers):
            q, k, v = r.qkv(l, h, p, rot); cache.write(l, p, k, v); kc, vc = cache.layer_kv(l, T + i + 1)
            h = r.finish_layer(l, h, r.attend(q, p, kc, vc, last_query=True))
        lg = r.logits(h)[0]; steps.append(lg.float().cpu()); toks.append(int(lg.argmax()))
    return toks, steps
runs = [run(), run()]
h = Harness(device="cuda", heartbeat_timeout_s=30.0, chunk_bytes=1 << 20)
runs += [run(), run(), run()]
h.close()
runs += [run(), run()]
bt, bs = runs[0]
for j, (t, st) in enumerate(runs):
    fd = next((i for i, (a, b) in enumerate(zip(bt, t)) if a != b), None)
    eqsteps = [torch.equal(a, b) for a, b in zip(bs, st)]
    first_neq = next((i for i, e in enumerate(eqsteps) if not e), None)
    info = ""
    if fd is not None:
        top = torch.topk(st[fd], 3); topb = torch.topk(bs[fd], 3)
        info = f"run top3 {top.values.tolist()} {top.indices.tolist()} base top3 {topb.values.tolist()} {topb.indices.tolist()}"
    print(j, "token_div", fd, "first_logits_neq_step", first_neq, info, flush=True)
