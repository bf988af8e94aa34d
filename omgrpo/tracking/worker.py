"""A background worker: calls run in order on one daemon thread behind a bounded queue (MLflow's
writes, so a slow or unreachable store does not hold up the training loop)."""

from __future__ import annotations

import queue
import threading
import time

MAX_QUEUED_CALLS = 256
"""Calls a worker holds before `submit` refuses more (the caller then drops them: the local run
store has everything, and `omgrpo sync` fills in what a tracker missed)."""


class Worker:
    """Runs calls in order on one daemon thread, so a slow backend does not hold up the
    training loop. The queue is bounded (`maxsize`): `submit` never blocks, it returns False
    when the queue is full and the call is not queued. The first error is re-raised on the
    caller's next `submit` / `wait` (where FanOutTracker catches it); calls queued after an
    error are dropped. `wait` gives up once no call has completed for `stall_s` seconds (a
    locked database): the thread is left to finish or die with the process."""

    def __init__(self, name: str, maxsize: int = MAX_QUEUED_CALLS):
        self.queue: queue.Queue = queue.Queue(maxsize=maxsize)
        self.error: BaseException | None = None
        self.abandoned = False
        self.last_progress = time.monotonic()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def submit(self, fn, *args) -> bool:
        """Queue `fn(*args)`; False (and nothing queued) when the queue is full."""
        self.raise_error()
        try:
            self.queue.put_nowait((fn, args))
        except queue.Full:
            return False
        return True

    def wait(self, stall_s: float | None = None) -> bool:
        """Whether every call submitted so far has run (re-raising the first error); False
        if no call completed for `stall_s` seconds (None: wait for ever)."""
        done = threading.Event()
        self.last_progress = time.monotonic()
        if not self._put_marker((done, ()), stall_s):
            return False
        while not done.wait(0.05):
            if stall_s is not None and time.monotonic() - self.last_progress > stall_s:
                return False
        self.raise_error()
        return True

    def close(self) -> None:
        """Stop the thread after the calls queued so far (without waiting for them; a queue
        that stays full without progress for 4 s leaves the daemon thread to the process)."""
        self._put_marker(None, 4.0)

    def abandon(self) -> None:
        """Drop every call not started yet (the one running cannot be interrupted)."""
        self.abandoned = True
        while True:  # make room for the stop marker
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        self.close()

    def raise_error(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def _put_marker(self, item, stall_s: float | None) -> bool:
        """Queue a wait() / close() marker, waiting for room while the worker makes progress."""
        while True:
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                if stall_s is not None and time.monotonic() - self.last_progress > stall_s:
                    return False
                if not self.thread.is_alive():
                    return False

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
