"""`mutmut run` for a device session that spans calls (scripts/device.sh mutation with SESSION=1, which runs this file
by path): writes its pid to /tmp/mutmut.pid and skips mutmut's clean-test run when this same process has just collected
the full test map (that collection runs the whole selection unmutated, and mutmut stops if it fails), so mutmut's setup
is paid once per session (2026-12-03: 155 s once instead of 100-200 s per call). Patches mutmut 3.8.1's internals
(hash-locked in requirements/mutation.lock): a change there shows as an AttributeError at start, nothing silent."""
from __future__ import annotations

import os
import sys
import time


def main(argv: list[str]) -> None:
    import mutmut.__main__ as mm
    from mutmut.workers import isolation

    with open("/tmp/mutmut.pid", "w") as f:
        f.write(str(os.getpid()))
    full_map = {"collected": False}
    collect, clean = mm.run_stats_collection, isolation.ForkServerRunner.run_clean_tests

    def run_stats_collection(runner, tests=None):  # noqa: ANN001, ANN202 (mutmut's own signature)
        t0 = time.time()
        collect(runner, tests)
        full_map["collected"] = full_map["collected"] or not tests
        print(f"[mutmut-session] test map ({'all tests' if not tests else 'changed tests'}) {time.time() - t0:.0f} s",
              flush=True)

    def run_clean_tests(self, tests):  # noqa: ANN001, ANN202
        if full_map["collected"]:
            print("[mutmut-session] clean-test run skipped: the full test map just ran the same tests unmutated",
                  flush=True)
            return 0
        return clean(self, tests)

    mm.run_stats_collection = run_stats_collection
    isolation.ForkServerRunner.run_clean_tests = run_clean_tests
    print(f"[mutmut-session] start {time.strftime('%H:%M:%S')}", flush=True)
    sys.argv = ["mutmut", "run", *argv]
    mm.cli()


if __name__ == "__main__":
    main(sys.argv[1:])
