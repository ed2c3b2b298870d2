"""Progress bars for long work (rich), quiet when output is not a terminal or disabled."""
from __future__ import annotations

import sys
from typing import Iterable, Iterator, TypeVar

T = TypeVar("T")


def track(items: Iterable[T], description: str, enabled: bool = True) -> Iterator[T]:
    if not enabled or not sys.stderr.isatty():
        yield from items
        return
    from rich.progress import track as rich_track

    yield from rich_track(items, description=description, transient=True, console=None)
