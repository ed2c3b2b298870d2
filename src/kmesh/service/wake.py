"""Work finished on helper threads, handed to the service's selector loop: a queue plus a non-blocking wake pipe
whose read end the loop watches. Any number of wake-ups means one thing — look at the queue — so a full pipe
is fine, and after close() a late finisher's wake-up is dropped (nobody is waiting any more)."""
from __future__ import annotations

import os
import queue
from typing import Generic, TypeVar

T = TypeVar("T")


class DoneQueue(Generic[T]):
    def __init__(self) -> None:
        self._q: queue.SimpleQueue[T] = queue.SimpleQueue()
        self.wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    def put(self, item: T) -> bool:
        """Hand item to the loop and wake it; False once the pipe is closed (teardown)."""
        self._q.put(item)
        return self._wake()

    def _wake(self) -> bool:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full of wake-ups: the loop is woken already
            pass
        except OSError:
            return False
        return True

    def put_many(self, items: list[T]) -> bool:
        """put() of every item in order, with one wake-up."""
        for item in items:
            self._q.put(item)
        return self._wake()

    def take_all(self) -> list[T]:
        """Everything finished since the last call (the loop thread; the wake-ups are consumed too)."""
        try:
            while os.read(self.wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        out: list[T] = []
        while True:
            try:
                out.append(self._q.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        os.close(self.wake_r)
        os.close(self._wake_w)
