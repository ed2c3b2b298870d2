"""Stage `report`: render tables (md/csv/tex) and plots (png/svg) from the result files that exist."""
from __future__ import annotations

from kmesh.config import Config
from kmesh.report.render import collect_results, render_all
from kmesh.result import Result


def run(cfg: Config) -> Result:
    res = Result.begin("report", cfg)
    with res.case("inputs") as c:
        results, problems = collect_results(cfg)
        c.record("stages", [r["stage"] for r in results])
        c.check("result_files_readable", not problems, problems)
        failed = [r["stage"] for r in results if r["summary"]["failed"]]
        # A failed stage is shown as FAILED in the tables; the report itself still renders.
        c.record("stages_with_failures", failed)
    with res.case("render") as c:
        written = render_all(cfg)
        c.record("files", [str(p.relative_to(cfg.root)) if p.is_relative_to(cfg.root) else str(p) for p in written])
        c.check("all_nonempty", bool(written) and all(p.stat().st_size > 0 for p in written),
                [str(p) for p in written if p.stat().st_size == 0])
    return res
