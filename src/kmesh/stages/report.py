"""Stage `report`: render tables (md/csv/tex) and plots (png/svg) from the result files that exist."""
from __future__ import annotations

from kmesh.config import Config
from kmesh.report.render import collect_results, render_all
from kmesh.result import Result


def run(cfg: Config) -> Result:
    res = Result.begin("report", cfg)
    with res.case("inputs") as case:
        results, problems = collect_results(cfg)
        case.record("stages", [r["stage"] for r in results])
        case.check("result_files_readable", not problems, problems)
        failed = [r["stage"] for r in results if r["summary"]["failed"]]
        # A failed stage is shown as FAILED in the tables; the report itself still renders.
        case.record("stages_with_failures", failed)
    with res.case("render") as case:
        written = render_all(cfg)
        case.record("files", [str(p.relative_to(cfg.root)) if p.is_relative_to(cfg.root) else str(p) for p in written])
        case.check("all_nonempty", bool(written) and all(p.stat().st_size > 0 for p in written),
                   [str(p) for p in written if p.stat().st_size == 0])
    return res
