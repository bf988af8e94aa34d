"""A background worker: calls run in order on one daemon thread (MLflow's writes, so a slow
store does not hold up the training loop)."""

from __future__ import annotations

import queue
import threading
import time


class Worker:
    """Runs calls in order on one daemon thread, so a slow backend does not hold up the
    training loop. The first error is re-raised on the caller's next `submit` / `wait`
    (where FanOutTracker catches it); calls queued after an error are dropped. `wait` gives up
    once no call has completed for `stall_s` seconds (a locked database): the thread is left
    to finish or die with the process."""

    def __init__(self, name: str):
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.abandoned = False
        self.last_progress = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> None:
        self.raise_error()
        self.queue.put((fn, args))

    def wait(self, stall_s: float | None = None) -> bool:
        """Whether every call submitted so far has run (re-raising the first error); False
        if no call completed for `stall_s` seconds (None: wait for ever)."""
        done = threading.Event()
        self.queue.put((done, ()))
        self.last_progress = time.monotonic()
        while not done.wait(0.05):
            if stall_s is not None and time.monotonic() - self.last_progress > stall_s:
                return False
        self.raise_error()
        return True

    def close(self) -> None:
        """Stop the thread after the calls queued so far (without waiting for them)."""
        self.queue.put(None)

    def abandon(self) -> None:
        """Drop every call not started yet (the one running cannot be interrupted)."""
        self.abandoned = True
        self.close()

    def raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _loop(self) -> None:
        while (item := self.queue.get()) is not None:
            fn, args = item
            if isinstance(fn, threading.Event):  # a wait() marker
                fn.set()
                continue
            try:
                if self.error is None and not self.abandoned:
                    fn(*args)
            except BaseException as e:
                self.error = e
            self.last_progress = time.monotonic()
