"""The one result file every stage writes (schema "kmesh.result/1", DESIGN §4).

    res = Result.begin("synthetic", cfg)
    with res.case("lbhnc-bf16-fwd", {"layout": "LBHNC"}) as c:
        c.check("values_identical", torch.equal(a, b))
        c.check("key_rel_err", err <= 1e-5, value=err)
    res.write(path)          # always written, also when cases failed
    sys.exit(0 if res.ok else 1)

A case passes iff every check passed and nothing raised. A skipped case (c.skip(reason)) is
neither passed nor failed and says why; a stage with skips is not "all passed".

A case that does not run here is never just left out: a stage records it with res.skip_case(id, params, reason),
and a config switch that turns cases off records them with res.disabled(switch, value, ids): skipped, their
reason naming the switch ("storage.read_once_service: false (disabled by config)"). So a profile cannot make a
stage ok by configuring its cases away: each such skip needs that profile's allowance like any other.

The stage is ok iff no case failed, at least one passed, and every skip is allowed: its case id matches
an entry of `<stage>.allow_skips` in the profile's config (Result.begin picks them up). The summary names
each skip as allowed (with the pattern and reason) or unallowed, and carries the allowance it applied.
"""
from __future__ import annotations

import json
import math
import os
import sys
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Iterable, Iterator

from kmesh.config import Config, SkipAllowance
from kmesh.errors import ResultError
from kmesh.jsonfile import read_json_schema, write_json_atomic

SCHEMA = "kmesh.result/1"
# What a stage prints (to stderr, its log under the pipeline) as each case starts and ends: the pipeline's console
# follows these lines to say how far a long stage is (kmesh.console).
CASE_STARTED = "[kmesh] case {number} started: {id}"
CASE_ENDED = "[kmesh] case {number} {outcome}: {id} ({seconds:.1f} s)"
CASE_FAILED_BECAUSE = "[kmesh]   {why}"


def to_jsonable(v: Any) -> Any:
    """Plain JSON types from numpy/torch scalars, tuples, paths; non-finite floats as strings."""
    if isinstance(v, dict):
        return {str(k): to_jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set)):
        return [to_jsonable(x) for x in v]
    if isinstance(v, Path):
        return str(v)
    if hasattr(v, "item") and callable(v.item) and getattr(v, "ndim", 0) == 0:
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return repr(v)


def disabled_reason(switch: str, value: Any) -> str:
    """The skip reason of cases turned off by a config switch: its dotted path and its value, as JSON."""
    return f"{switch}: {json.dumps(to_jsonable(value))} (disabled by config)"


class _Skip(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Case:
    id: str
    params: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None
    skipped: str | None = None
    seconds: float | None = None

    @property
    def passed(self) -> bool | None:
        if self.skipped is not None:
            return None
        # At least one real check, none failed: a case that only recorded values has proven nothing.
        real = [c["ok"] for c in self.checks.values() if c["ok"] is not None]
        return self.error is None and bool(real) and all(real)

    def failed_because(self, value_chars: int = 300) -> str:
        """One line: the failed checks with the start of their values, or the error's first line, or that no check
        ran."""
        if self.error is not None:
            return "error: " + self.error.splitlines()[0][:value_chars]
        failed = [f"{k} = {json.dumps(v['value'])[:value_chars]}" for k, v in self.checks.items() if v["ok"] is False]
        return "failed checks: " + "; ".join(failed) if failed else "no check ran"

    def check(self, name: str, ok: bool, value: Any = None) -> bool:
        """Record a pass/fail check. Returns ok so callers can branch on it."""
        if name in self.checks:
            raise ValueError(f"case {self.id}: check {name!r} recorded twice")
        self.checks[name] = {"ok": bool(ok), "value": to_jsonable(value)}
        return bool(ok)

    def record(self, name: str, value: Any) -> None:
        """Record an informational value (no pass/fail)."""
        if name in self.checks:  # never let a value overwrite (and so hide) a failed check
            raise ValueError(f"case {self.id}: {name!r} recorded twice")
        self.checks[name] = {"ok": None, "value": to_jsonable(value)}

    def skip(self, reason: str) -> None:
        """Stop this case here and mark it skipped with a reason."""
        raise _Skip(reason)

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "params": to_jsonable(self.params), "passed": self.passed,
                "checks": self.checks, "error": self.error, "skipped": self.skipped,
                "seconds": self.seconds}


class Result:
    def __init__(self, stage: str, profile: str, provenance: dict[str, Any],
                 allow_skips: tuple[SkipAllowance, ...] = ()) -> None:
        self.stage = stage
        self.profile = profile
        self.provenance = provenance
        self.allow_skips = tuple(allow_skips)
        self.cases: list[Case] = []
        self.timings: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}

    @classmethod
    def begin(cls, stage: str, cfg: Config) -> "Result":
        from kmesh.provenance import collect

        return cls(stage, cfg.profile, collect(cfg), cfg.skip_allowances(stage))

    @contextmanager
    def case(self, case_id: str, params: dict[str, Any] | None = None) -> Iterator[Case]:
        """Run one case; an exception inside fails the case (recorded with its traceback tail)."""
        import time

        if any(c.id == case_id for c in self.cases):
            raise ValueError(f"duplicate case id {case_id!r}")
        c = Case(case_id, dict(params or {}))
        self.cases.append(c)
        number = len(self.cases)
        print(CASE_STARTED.format(number=number, id=case_id), file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            yield c
        except _Skip as s:
            c.skipped = s.reason
        except Exception as e:  # the case fails; the stage goes on with the next case
            tb = traceback.format_exception(type(e), e, e.__traceback__)
            c.error = f"{type(e).__name__}: {e}\n" + "".join(tb[-3:])
        finally:
            c.seconds = time.perf_counter() - t0
            outcome = {True: "passed", False: "failed", None: "skipped"}[c.passed]
            print(CASE_ENDED.format(number=number, outcome=outcome, id=case_id, seconds=c.seconds),
                  file=sys.stderr, flush=True)
            if c.passed is False:   # in the log too: Snakemake deletes a failed stage's result file
                print(CASE_FAILED_BECAUSE.format(why=c.failed_because()), file=sys.stderr, flush=True)

    def skip_case(self, case_id: str, params: dict[str, Any] | None, reason: str) -> Case:
        """Record a case that does not run here as skipped with `reason`, under the id it has when it runs."""
        if not reason:
            raise ValueError(f"case {case_id!r}: a skip needs a reason")
        with self.case(case_id, params) as c:
            c.skip(reason)
        return c

    def disabled(self, switch: str, value: Any, case_ids: Iterable[str],
                 params: dict[str, Any] | None = None) -> list[Case]:
        """The cases that config switch `switch` (its dotted path) turns off with `value`, each recorded as
        skipped with a reason naming the switch and its value."""
        reason = disabled_reason(switch, value)
        return [self.skip_case(case_id, {**(params or {}), "disabled_by": switch}, reason) for case_id in case_ids]

    def skip_verdicts(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(allowed, unallowed) skips: each allowed one with the first allowance whose glob matches its id."""
        allowed: list[dict[str, Any]] = []
        unallowed: list[dict[str, Any]] = []
        for c in self.cases:
            if c.skipped is None:
                continue
            a = next((a for a in self.allow_skips if fnmatchcase(c.id, a.case)), None)
            if a is None:
                unallowed.append({"case": c.id, "skipped": c.skipped})
            else:
                allowed.append({"case": c.id, "skipped": c.skipped, "pattern": a.case, "reason": a.reason})
        return allowed, unallowed

    def summary(self) -> dict[str, Any]:
        passed = sum(c.passed is True for c in self.cases)
        failed = sum(c.passed is False for c in self.cases)
        skipped = sum(c.passed is None for c in self.cases)
        allowed, unallowed = self.skip_verdicts()
        # The verdict keys come last so that a stage's extra values can never overwrite them.
        return {**to_jsonable(self.extra), "cases": len(self.cases), "passed": passed, "failed": failed,
                "skipped": skipped, "all_passed": failed == 0 and skipped == 0 and passed > 0,
                "ok": failed == 0 and passed > 0 and not unallowed,
                "skips_allowed": allowed, "skips_unallowed": unallowed,
                "allow_skips": [asdict(a) for a in self.allow_skips]}

    @property
    def ok(self) -> bool:
        """The stage succeeded: no case failed, one passed, and every skip is allowed by this profile."""
        return bool(self.summary()["ok"])

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "stage": self.stage, "profile": self.profile,
                "provenance": to_jsonable(self.provenance),
                "cases": [c.to_dict() for c in self.cases],
                "timings": to_jsonable(self.timings), "summary": self.summary()}

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Atomically write the file (temp + rename), stamping the end time and the CPU spent so far."""
        from kmesh.provenance import now, resource_use

        self.provenance["end"] = now()
        zygotes = sys.modules.get("kmesh.zygote")
        if zygotes is not None:
            # engines forked from a zygote are its children: their CPU reaches ours once the zygote is reaped
            zygotes.close_all()
        self.provenance["resources"] = resource_use()
        return write_json_atomic(path, self.to_dict())


def load_result(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a result file and check its schema id and required keys."""
    data = read_json_schema(path, SCHEMA, ResultError, "result file")
    for key in ("stage", "profile", "provenance", "cases", "timings", "summary"):
        if key not in data:
            raise ResultError(f"result file {path} lacks {key!r}")
    return data
