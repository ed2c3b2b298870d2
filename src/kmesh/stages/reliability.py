"""Stage `reliability` (issue 26): what production sends the cache service, as figures anyone can rerun.

Four cases, each over real processes (kmesh.reliability), sizes from `reliability.*` (the cpu profile's short form;
the long form by config, e.g. `--set reliability.soak.seconds=600`):
  soak       N client processes for T seconds against one service whose RAM holds a fraction of the working set
             (disk tier under it): ops, verified loads, mismatches (0), refusals (0: the disk tier takes what RAM
             cannot), the service's RSS by halves of the run, fds and memfd mappings back to the start, no
             registration or pin left (kmesh.reliability.soak);
  fuzz       valid request sequences from 3 clients, every reply against the ownership model: 0 divergences, every
             outcome kind the rules name reached (kmesh.reliability.fuzz);
  crash      the service SIGKILLed at random points of saves, spills and disk reads, restarted over its disk dir:
             every save acknowledged `done` present, every adopted object loads back as its key names, no temp file
             left (kmesh.reliability.crash);
  churn      vLLM engines with KMeshConnector SIGKILLed mid-request: every registration released, a new engine's
             tokens equal the reference's, no noted original changed (kmesh.reliability.churn; needs the converted
             SmolLM2 of stage `model` and the pinned vLLM).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kmesh.config import Config
from kmesh.result import Result

SOAK_RSS_GROWTH_KIB = 64 << 10   # second-half vs first-half median VmRSS: more than this is growth, not noise


def _soak(res: Result, sec: dict[str, Any], work: Path, seed: int) -> None:
    from kmesh.reliability.soak import SoakSpec, run_soak

    spec = SoakSpec(**{**sec, "seed": seed})
    with res.case("soak", dict(sec)) as case:
        f = run_soak(spec, work / "soak")
        case.record("figures", f)
        case.check("clients_finished", not f["client_failures"], f["client_failures"])
        case.check("service_alive", f["service_alive"])
        case.check("every_load_verified", f["mismatches"] == 0 and f["verified_loads"] == f["loads"].get("done", 0),
                   {"verified": f["verified_loads"], "mismatches": f["mismatches"]})
        case.check("load_held", f["ops"] >= spec.clients and f["store_counters"]["lru_spilled"] > 0,
                    {"ops": f["ops"], "spilled": f["store_counters"]["lru_spilled"]})
        case.check("no_save_refused", not f["refusals"] and f["store_counters"]["lru_refused"] == 0, f["refusals"])
        case.check("originals_intact", not f["objects_wrong"], f["objects_wrong"])
        case.check("nothing_left", f["registrations_left"] == 0 and not f["clients_left"] and f["pins_left"] == 0,
                   {k: f[k] for k in ("registrations_left", "clients_left", "pins_left")})
        case.check("fds_and_mappings_back", f["service_after"]["fd_targets"] == f["service_before"]["fd_targets"]
                   and f["service_after"]["memfd_mappings"] == f["service_before"]["memfd_mappings"],
                   {"before": f["service_before"], "after": f["service_after"]})
        growth = None if f["rss_kib_second_half_median"] is None else \
            f["rss_kib_second_half_median"] - f["rss_kib_first_half_median"]
        case.check("rss_bounded", growth is not None and growth <= SOAK_RSS_GROWTH_KIB,
                   {"second_minus_first_half_kib": growth, "limit_kib": SOAK_RSS_GROWTH_KIB})
        case.check("no_internal_errors", f["internal_errors"] == 0, f["internal_errors"])
        res.extra["soak"] = {"load": f"{f['ops']} ops by {spec.clients} clients in {f['wall_s']:.0f} s; "
                                     f"{spec.working_set} objects over a {spec.ram_objects}-object RAM tier",
                             "faults": f"{f['cancels_sent']} loads cancelled mid-copy",
                             "bad_inputs": None, "divergences": f["mismatches"], "service_survived": f["service_alive"],
                             "data_lost": f["mismatches"] + len(f["objects_wrong"]),
                             "verified_loads": f["verified_loads"], "rss_growth_kib": growth,
                             "internal_errors": f["internal_errors"]}


def _fuzz(res: Result, sec: dict[str, Any], work: Path, seed: int) -> None:
    from kmesh.reliability import fuzz
    from kmesh.reliability.soak import proc_figures
    from kmesh.service import process

    with res.case("fuzz", dict(sec)) as case:
        sp = process.start(work / "fuzz-rt", store_bytes=512 * fuzz.N, heartbeat_timeout_s=60.0)
        batches: list[dict[str, Any]] = []
        progress = work / "fuzz-batches.jsonl"    # a long run's figures so far, also if it is stopped

        def on_batch(b: dict[str, Any]) -> None:
            b = {**b, "seconds": round(b["seconds"], 2), **proc_figures(sp.pid)}
            batches.append(b)
            with progress.open("a") as f:
                f.write(json.dumps(b) + "\n")
            print(f"[reliability] fuzz batch {b['batch']}: {b['steps']} requests in {b['seconds']:.1f} s, "
                  f"{b['total_steps']} in all; service RSS {b['rss_kib']} KiB, {b['fds']} fds",
                  file=sys.stderr, flush=True)
        try:
            divergence = None
            progress.parent.mkdir(parents=True, exist_ok=True)
            progress.unlink(missing_ok=True)
            try:
                counts = fuzz.run_fuzz(sp, int(sec["examples"]), int(sec["steps"]), seed=seed,
                                       min_steps=int(sec["min_steps"]), on_batch=on_batch)
            except Exception as e:   # a divergence, shrunk by hypothesis (the minimal sequence is in the message)
                counts, divergence = fuzz.outcomes_so_far(), f"{type(e).__name__}: {str(e)[:4000]}"
            alive = sp.alive()
            with sp.admin_client(name="fuzz-end") as adm:
                internal = adm.summary("all")["stats"]["internal_errors"]
        finally:
            sp.stop()
        case.record("outcomes", counts)
        case.check("no_internal_errors", internal == 0, internal)
        case.record("batches", batches)
        case.check("no_divergence", divergence is None, divergence)
        case.check("every_outcome_reached", not fuzz.MUST_REACH - set(counts), sorted(fuzz.MUST_REACH - set(counts)))
        case.check("service_alive", alive)
        steps = fuzz.steps_of(counts)
        case.check("min_steps_made", steps >= int(sec["min_steps"]), {"steps": steps, "min_steps": sec["min_steps"]})
        refused = sum(v for k, v in counts.items() if ":" in k and not k.endswith((":accepted", ":replaced",
                                                                                      ":evicted", ":kept-retained")))
        res.extra["fuzz"] = {"load": f"{steps} valid requests in {counts.get('batches')} batch(es) of "
                                     f"{sec['examples']} sequences",
                             "faults": f"{counts.get('disconnect', 0)} disconnects", "bad_inputs": refused,
                             "divergences": 0 if divergence is None else 1, "service_survived": alive,
                             "data_lost": 0 if divergence is None else None, "internal_errors": internal}


def _crash(res: Result, sec: dict[str, Any], work: Path, seed: int) -> None:
    from kmesh.reliability.crash import CrashSpec, run_crash

    with res.case("crash", dict(sec)) as case:
        f = run_crash(CrashSpec(**{**sec, "seed": seed}), work / "crash")
        case.record("figures", f)
        cut = sum(v for k, v in f["counters"].items() if k.startswith("client_cut:"))
        case.check("every_kill_cut_a_working_client", f["kills"] == int(sec["kills"]) == cut,
                   {"kills": f["kills"], "client_connections_cut": cut})
        case.check("durable_saves_survive", not [p for p in f["problems"] if "durable_missing" in p], f["problems"])
        case.check("adopted_objects_verify", not [p for p in f["problems"] if "adopted_wrong" in p]
                   and f["load_mismatches"] == 0, f["problems"])
        case.check("no_temp_file_left", not [p for p in f["problems"] if "temp_files_left" in p], f["problems"])
        case.check("saves_acknowledged", f["saves_acknowledged"] > 0, f["saves_acknowledged"])
        case.check("no_internal_errors", f["internal_errors"] == 0, f["internal_errors"])
        lost = sum(len(p.get("durable_missing", [])) + len(p.get("adopted_wrong", [])) for p in f["problems"])
        res.extra["crash"] = {"load": f"{f['saves_acknowledged']} saves acknowledged, {f['loads_verified']} loads; "
                                      f"{f['loads_after_restart_verified']} loads after restarts",
                              "faults": f"{f['kills']} service SIGKILLs",
                              "bad_inputs": f"{f['temp_files_removed']} temp files of interrupted writes",
                              "divergences": len(f["problems"]),
                              # killed on purpose: what counts is that it came back over its disk dir every time
                              "service_survived": f"restarted {f['kills']} of {int(sec['kills'])} times",
                              "data_lost": lost, "internal_errors": f["internal_errors"],
                              "committed_unacknowledged": f["committed_unacknowledged"]}


def _churn(res: Result, cfg: Config, sec: dict[str, Any], work: Path, seed: int) -> None:
    from kmesh.model import smollm2
    from kmesh.reliability.churn import ChurnSpec, run_churn

    vsec = cfg.section("vllm")
    with res.case("churn", dict(sec)) as case:
        model = smollm2.converted_dir(cfg)
        extra = {"staging_blocks": int(vsec["staging_blocks"]), "retry_s": float(vsec["retry_s"]),
                 "repair": dict(vsec["repair"]), "repair_model": str(model)}
        f = run_churn(model, ChurnSpec(**{**sec, "seed": seed, "dtype": vsec["dtype"],
                                          "threads_bind": str(sec.get("threads_bind", vsec["threads_bind"]))}),
                              work / "churn", extra)
        case.record("figures", f)
        case.check("every_kill_mid_request", f["kills"] == int(sec["kills"]) == f["killed_while_running"],
                   {"kills": f["kills"], "while_running": f["killed_while_running"]})
        case.check("registrations_released", f["registrations_released_every_kill"], f["problems"])
        case.check("tokens_equal_after_churn", f["tokens_equal_after_churn"],
                   {"reference": f["reference_tokens"], "after": f["tokens_after"]})
        case.check("originals_unchanged", f["originals_noted"] > 0 and not f["originals_changed"],
                   f["originals_changed"])
        case.check("service_alive_and_empty", f["service_alive"] and f["registrations_left"] == 0,
                   {"alive": f["service_alive"], "registrations_left": f["registrations_left"]})
        case.check("no_internal_errors", f["internal_errors"] == 0, f["internal_errors"])
        res.extra["churn"] = {"load": f"{f['kills']} long requests, each killed while it ran",
                              "faults": f"{f['kills']} engine SIGKILLs (released within {f['release_s_max']:.2f} s)"
                              if f["release_s_max"] is not None else f"{f['kills']} engine SIGKILLs",
                              "bad_inputs": None, "divergences": int(not f["tokens_equal_after_churn"]),
                              "service_survived": f["service_alive"], "data_lost": len(f["originals_changed"]),
                              "internal_errors": f["internal_errors"]}


def run(cfg: Config) -> Result:
    res = Result.begin("reliability", cfg)
    sec = cfg.section("reliability")
    work = cfg.stage_dir("reliability") / "work"
    _soak(res, dict(sec["soak"]), work, cfg.seed)
    _fuzz(res, dict(sec["fuzz"]), work, cfg.seed)
    _crash(res, dict(sec["crash"]), work, cfg.seed)
    if cfg.section("vllm")["enabled"]:
        _churn(res, cfg, dict(sec["churn"]), work, cfg.seed)
    else:
        res.disabled("vllm.enabled", False, ["churn"])
    return res
