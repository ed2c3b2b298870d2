"""A log of what a stage module's timed arms run on which cache: its `blend` (with the arm) and `restore_child`,
wrapped in place, the real functions still doing the work. For tests of what each TTFT arm times (ttft, rag)."""
from __future__ import annotations

import inspect
from typing import Any


class PrefillLog:
    """`events`: (kind, arm, cache) in call order, kind "blend" (arm as the real function's defaults resolve it) or
    "restore" (arm None). The caches are held, so their identities stay unique."""

    def __init__(self, monkeypatch: Any, module: Any) -> None:
        self.events: list[tuple[str, str | None, Any]] = []
        real_blend, real_restore = module.blend, module.restore_child
        signature = inspect.signature(real_blend)

        def blend(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self.events.append(("blend", bound.arguments["arm"], bound.arguments["cache"]))
            return real_blend(*args, **kwargs)

        def restore_child(cache: Any, *args: Any, **kwargs: Any) -> Any:
            self.events.append(("restore", None, cache))
            return real_restore(cache, *args, **kwargs)

        monkeypatch.setattr(module, "blend", blend)
        monkeypatch.setattr(module, "restore_child", restore_child)

    def blend_arms(self) -> set[str]:
        return {arm for kind, arm, _ in self.events if kind == "blend"}

    def misordered(self) -> list[tuple[str, str | None]]:
        """What breaks the arms' rule, as (kind, arm) in call order: a restore into a full arm's cache, or a reuse
        arm's prefill whose cache was not restored since its last prefill (a reuse arm's every run, timed or not,
        is restore + prefill)."""
        full = {id(cache) for kind, arm, cache in self.events if kind == "blend" and arm == "full"}
        last: dict[int, str] = {}
        bad = []
        for kind, arm, cache in self.events:
            if (kind == "restore" and id(cache) in full) or (
                    kind == "blend" and arm != "full" and last.get(id(cache)) != "restore"):
                bad.append((kind, arm))
            last[id(cache)] = kind
        return bad
