"""Joining a trainer's weight-update group without stopping the engine: the rendezvous (the
trainer's ``TCPStore``, then the process group) runs in a thread of the engine's process, which
releases the GIL while it waits, so the engine goes on stepping; the group is usable once the
thread is done. A trainer that never joins costs a thread until the group's timeout, not the
engine's generation; ``/health`` shows the join meanwhile (``state``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from bi_core.errors import BiEngineError
from bi_core.rl.sync_protocol import WeightGroup

GRACE_S = 5.0  # past its timeout, a join still running (the store's connect, then the group's) is given up


class Join:
    """One group being joined by a thread of this process."""

    def __init__(self, name: str, make: Callable[[], WeightGroup], timeout_s: float) -> None:
        self.name, self.timeout_s = name, timeout_s
        self.started = time.monotonic()
        self.group: WeightGroup | None = None
        self.error: BaseException | None = None
        self._abandoned = False
        self._lock = threading.Lock()
        self._done = threading.Event()
        # daemon: a process that stops meanwhile does not wait for a rendezvous that will not come
        threading.Thread(target=self._run, args=(make,), name=f"bi-engine-join-{name}", daemon=True).start()

    def _run(self, make: Callable[[], WeightGroup]) -> None:
        try:
            group = make()
        except BaseException as e:  # noqa: BLE001 - the caller reads it (a BiEngineError naming the stage)
            self.error = e
        else:
            with self._lock:
                self.group = group
                if self._abandoned:  # nobody will use it: leave the group at once
                    group.close()
        finally:
            self._done.set()

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.started

    def done(self) -> bool:
        """The thread ended, or the join ran past its timeout (it is then given up)."""
        return self._done.is_set() or self.elapsed_s > self.timeout_s + GRACE_S

    def result(self) -> WeightGroup:
        """The group, once ``done``; else the error its thread ended with (or a timeout)."""
        if not self._done.is_set():
            self.abandon()
            raise BiEngineError(f"joining weight-update group '{self.name}': timed out after {self.timeout_s:g} s "
                                "(the trainer did not join)")
        if self.error is not None:
            raise self.error
        return self.group

    def wait(self) -> WeightGroup:
        """Block until ``done``, then ``result``."""
        self._done.wait(max(0.0, self.timeout_s + GRACE_S - self.elapsed_s))
        return self.result()

    def abandon(self) -> None:
        """Nobody will use the group: it is left as soon as the thread has it."""
        with self._lock:
            self._abandoned = True
            if self.group is not None:
                self.group.close()
                self.group = None

    def state(self) -> dict:
        return {"state": "joining", "elapsed_s": round(self.elapsed_s, 1), "timeout_s": self.timeout_s}
