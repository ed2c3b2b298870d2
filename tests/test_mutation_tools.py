"""kmesh.devtools.mutation_report's survivor diffs, read from mutmut's generated module in-process (no mutmut run:
a hand-written module of the shape mutmut generates, an original and two mutants of a function and of a method)."""
from __future__ import annotations

from pathlib import Path

from kmesh.devtools.mutation_report import mutant_diff, split

GENERATED = '''
def x_total__mutmut_orig(a, b):
    s = a + b
    return s * 2

def x_total__mutmut_1(a, b):
    s = a - b
    return s * 2

def x_total__mutmut_2(a, b):
    s = a + b
    return s * 3

class Box:
    def xǁBoxǁsize__mutmut_orig(self):
        return len(self.items)

    def xǁBoxǁsize__mutmut_1(self):
        return len(None)
'''


def test_survivor_diffs_read_from_the_generated_module(tmp_path: Path):
    root = tmp_path / "mutants" / "src"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "mod.py").write_text(GENERATED, "utf-8")
    cache: dict = {}
    assert mutant_diff("pkg.mod.x_total__mutmut_1", root, cache) == "-    s = a + b\n+    s = a - b"
    assert mutant_diff("pkg.mod.x_total__mutmut_2", root, cache) == "-    return s * 2\n+    return s * 3"
    assert mutant_diff("pkg.mod.xǁBoxǁsize__mutmut_1", root, cache) == (
        "-        return len(self.items)\n+        return len(None)")
    assert mutant_diff("pkg.mod.x_total__mutmut_9", root, cache) == ""        # no such mutant
    assert mutant_diff("pkg.other.x_total__mutmut_1", root, cache) == ""      # no such module
    assert split("pkg.mod.xǁBoxǁsize__mutmut_1") == ("pkg.mod", "Box.size")
    assert split("pkg.mod.x_total__mutmut_2") == ("pkg.mod", "total")
