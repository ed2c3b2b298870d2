"""Each stage's time as the pipeline recorded it: wall seconds (its result's provenance, start to end), CPU seconds
(its own and its reaped children's) and its case count.

The pipeline's console says from these how long a starting stage is expected to take and how many cases it has:
the last run's record in the same results folder where one is left (Snakemake deletes a job's outputs before it
runs it, so the console reads them first), else the committed table `docs/measurements/stage-times.json` of the
same profile and overlay. `python -m kmesh times` prints a results folder's records as docs/testing.md's table and
`--write` puts them into the committed table.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable

COMMITTED = Path(__file__).resolve().parents[2] / "docs" / "measurements" / "stage-times.json"


@dataclass(frozen=True)
class StageTime:
    stage: str
    wall_s: float
    cpu_s: float | None
    cases: int
    threads: int | None   # torch's intra-op threads in the stage's process
    rev: str              # the code revision that ran it (first 7 hex digits)
    started: str          # ISO time the stage began


def variant(profile: str, overlays: Iterable[str] = ()) -> str:
    """The key of a profile run with its overlays, e.g. "cpu", "cpu+test", "cpu+long"."""
    names = [Path(str(o)).stem for o in overlays]
    return "+".join([profile, *names])


def read_stage_time(path: Path) -> StageTime | None:
    """The stage time a result file records (None where it cannot be read or predates the records)."""
    try:
        data = json.loads(path.read_text())
        prov = data["provenance"]
        wall = (datetime.fromisoformat(prov["end"]) - datetime.fromisoformat(prov["start"])).total_seconds()
        cpu = prov.get("resources", {}).get("cpu_s")
        return StageTime(stage=str(data["stage"]), wall_s=round(wall, 1),
                         cpu_s=None if cpu is None else round(float(cpu), 1), cases=len(data["cases"]),
                         threads=prov.get("torch_threads"), rev=str(prov["kmesh"]["rev"])[:7],
                         started=str(prov["start"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def result_variant(path: Path) -> str | None:
    """The variant (profile and overlays) a result file was run with."""
    try:
        data = json.loads(path.read_text())
        return variant(data["profile"], data["provenance"]["config"].get("overlays") or ())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def recorded(results_dir: Path, profile: str, want: str | None = None) -> dict[str, StageTime]:
    """The stage times in `<results_dir>/<profile>/*/result.json`, by stage; with `want`, only the results run as
    that variant (a folder's results from another overlay are not this run's expectation)."""
    out: dict[str, StageTime] = {}
    for path in sorted((results_dir / profile).glob("*/result.json")):
        if want is not None and result_variant(path) != want:
            continue
        t = read_stage_time(path)
        if t is not None:
            out[t.stage] = t
    return out


def committed(path: Path = COMMITTED) -> dict[str, dict[str, Any]]:
    """The committed table: {variant: {"machine", "note", "stages": {stage: StageTime fields}}}."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@dataclass(frozen=True)
class Expectation:
    wall_s: float
    cases: int
    source: str   # "last run here" | "committed table at <rev>"


def expectations(results_dir: Path, profile: str, overlays: Iterable[str] = (),
                 table: Path = COMMITTED) -> dict[str, Expectation]:
    """What each stage is expected to take: this folder's last record of the same variant, else the committed one."""
    want = variant(profile, overlays)
    out: dict[str, Expectation] = {}
    for stage, row in committed(table).get(want, {}).get("stages", {}).items():
        try:
            out[stage] = Expectation(float(row["wall_s"]), int(row["cases"]), f"committed table at {row['rev']}")
        except (KeyError, TypeError, ValueError):
            continue
    for stage, t in recorded(results_dir, profile, want).items():
        out[stage] = Expectation(t.wall_s, t.cases, "last run here")
    return out


def markdown(times: dict[str, StageTime], order: Iterable[str]) -> str:
    """The table docs/testing.md carries: one row per stage in pipeline order (with when it started, seconds after the
    first stage did: what ran beside what), then the sums and the span."""
    rows = ["| stage | starts at | wall | CPU | CPU / wall | cases | threads |", "|---|---:|---:|---:|---:|---:|---:|"]
    first = min((datetime.fromisoformat(t.started).timestamp() for t in times.values()), default=0.0)
    wall = cpu = 0.0
    for stage in order:
        t = times.get(stage)
        if t is None:
            continue
        wall += t.wall_s
        cpu += t.cpu_s or 0.0
        ratio = f"{t.cpu_s / t.wall_s:.2f}" if t.cpu_s is not None and t.wall_s > 0 else ""
        at = datetime.fromisoformat(t.started).timestamp() - first
        rows.append(f"| {stage} | {at:.0f} s | {t.wall_s:.0f} s | {'' if t.cpu_s is None else f'{t.cpu_s:.0f} s'} | "
                    f"{ratio} | {t.cases} | {t.threads if t.threads is not None else ''} |")
    rows.append(f"| sum | | {wall:.0f} s | {cpu:.0f} s | | | |")
    rows.append(f"| first start to last end | | {span(times):.0f} s | | | | |")
    return "\n".join(rows)


def from_committed(key: str, path: Path = COMMITTED) -> dict[str, StageTime]:
    """One variant's stage times as the committed table holds them (empty where it holds none)."""
    stages = committed(path).get(key, {}).get("stages", {})
    return {stage: StageTime(**row) for stage, row in stages.items()}


def span(times: dict[str, StageTime]) -> float:
    """Seconds from the first stage's start to the last stage's end (what the stages took together, side by side
    where they ran so)."""
    if not times:
        return 0.0
    starts = [datetime.fromisoformat(t.started) for t in times.values()]
    ends = [datetime.fromisoformat(t.started).timestamp() + t.wall_s for t in times.values()]
    return max(ends) - min(s.timestamp() for s in starts)


def write_committed(times: dict[str, StageTime], key: str, machine: str, note: str, path: Path = COMMITTED) -> None:
    """Put one variant's records into the committed table (the other variants are kept)."""
    data = committed(path)
    data[key] = {"machine": machine, "note": note, "stages": {s: asdict(t) for s, t in sorted(times.items())}}
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
