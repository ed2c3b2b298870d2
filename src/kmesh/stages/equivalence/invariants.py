"""Cases repair-self-consistent and repair-matches-float64: the repair held to its algorithm, not to itself.

repair-self-consistent  a child whose restored positions hold the K/V its OWN full prefill computed must give that
                        prefill's K/V and logits back, within the dtype's rounding, at the repair's ratio and at 1.0
repair-matches-float64  every replayed child's repaired outcome (its child-<name> case's in-process run, equal to the
                        service's bit for bit) replayed in float64: recomputed rows, selection, forced positions,
                        masks, untouched restored rows, logits (kmesh.harness.invariants)
"""
from __future__ import annotations

import dataclasses

from kmesh.harness.invariants import (REFERENCE, check_replays, check_self_consistent, ratio_sets, replay_outcome,
                                      self_consistent)
from kmesh.harness.modelsetup import ModelSetup
from kmesh.reference.decoder import Float64Decoder
from kmesh.result import Result
from kmesh.stages.equivalence.refs import FULL, REPAIR, RefKey, Refs


def invariant_cases(res: Result, setup: ModelSetup, refs: Refs) -> None:
    """Both cases over the first `invariants.children` children (see module doc)."""
    sec = setup.sec["invariants"]
    children = list(setup.workload.children)[: int(sec["children"])]
    names = [c.name for c in children]
    bound = float(sec["self_consistent_bound"])
    params = {"children": names, "ratios": {k: list(v) for k, v in ratio_sets(setup.ctx.repair).items()},
              "bound_rel": bound, "restored": "the child's own full-prefill K/V at its segment positions"}
    with res.case("repair-self-consistent", params) as case:
        per_run = {f"{child.name}/{label}": d for child in children
                   for label, d in self_consistent(setup.ctx, child, refs[RefKey(FULL, child.name)]).items()}
        check_self_consistent(case, per_run, bound)
    rows_bound, logits_bound = float(sec["rows_rel_bound"]), float(sec["logits_rel_bound"])
    band = float(sec.get("tie_band_factor", 4.0))
    params = {"children": names, "repair": dataclasses.asdict(setup.ctx.repair), "reference": REFERENCE,
              "rows_rel_bound": rows_bound, "logits_rel_bound": logits_bound, "tie_band_factor": band}
    with res.case("repair-matches-float64", params) as case:
        dec = Float64Decoder(setup.runner.model, setup.runner.rope, setup.runner.device)
        report = {child.name: replay_outcome(dec, setup.ctx, setup.export, child, refs[RefKey(REPAIR, child.name)],
                                             band) for child in children}
        check_replays(case, report, rows_bound, logits_bound)
