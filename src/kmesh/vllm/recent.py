"""The scheduler's memory of prefix keys already stored or planned for saving: a bounded LRU.

It only spares work: a forgotten key costs one redundant save attempt (the service refuses an original that
exists, so the payload is never stored twice), a remembered one that is no longer stored costs a missed save.
So it may forget the least recently used keys to stay within `capacity`, and the connector forgets a key the
moment a lookup finds no record for it (evicted from the service, or its save was skipped or failed), together with
every later block of that prompt (a prefix chain is only usable up to its first missing block, and what follows it
may be gone too), and forgets everything when its link connects to the service anew (a restarted service holds
nothing of what the old one stored).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class RecentKeys:
    """A set of at most `capacity` keys; adding or touching makes a key the most recently used."""

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"RecentKeys needs a capacity >= 1, got {capacity!r}")
        self.capacity = capacity
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def touch(self, key: bytes) -> bool:
        """Is key remembered? If so it becomes the most recently used."""
        if key not in self._keys:
            return False
        self._keys.move_to_end(key)
        return True

    def add(self, keys: Iterable[bytes]) -> None:
        for key in keys:
            self._keys[key] = None
            self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def discard(self, key: bytes) -> None:
        self._keys.pop(key, None)

    def clear(self) -> None:
        self._keys.clear()
