"""The per-child outcomes the equivalence stage's later cases compare with: one full-recompute reference per child
(made before the service starts) and one repaired in-process outcome per child (made by its child-<name> case)."""
from __future__ import annotations

from dataclasses import dataclass

from kmesh.harness.child import ChildOutcome

FULL = "full"      # the full recompute of the child's prompt, no segments (kmesh.harness.child.full_reference)
REPAIR = "repair"  # the child repaired from segments staged in-process (its child-<name> case's first run)


@dataclass(frozen=True)
class RefKey:
    arm: str       # FULL or REPAIR
    child: str     # the workload child's name


Refs = dict[RefKey, ChildOutcome]
