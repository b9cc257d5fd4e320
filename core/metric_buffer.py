"""Training metrics that survive a tracking-server outage without stopping training.

The training loop logs a metric dict every `log_interval` steps. Sent synchronously, an MLflow server that
stays down longer than the client's own retries (minutes) raises inside the worker, Ray Train counts a worker
failure and the run restarts from its last checkpoint: an outage of the bookkeeping costs training. Here the
loop only appends to a queue; one background thread sends the points in order, waiting and retrying while
the server is unreachable, and says once when it went away and when it came back. Each point keeps the time
it was measured, so a late delivery does not bend the curves.

Nothing is dropped while the process lives: a point is about 1 KB, so a day-long outage at one point a
second holds ~90 MB. At the end `close()` waits a bounded time and returns the points it could not send, so
the stage can report them instead of failing.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

Point = tuple[dict[str, float], int, int]
"""(metrics, step, wall-clock ms when measured)."""


class MetricBuffer:
    """An ordered, retrying sender of `send(metrics, step, timestamp_ms)` calls on a background thread."""

    def __init__(self, send: Callable[[dict[str, float], int, int], None], retry_s: float = 5.0,
                 say: Callable[[str], None] = print):
        self._send, self._retry_s, self._say = send, retry_s, say
        self._points: collections.deque[Point] = collections.deque()
        self._wake = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._drain, name="metric-buffer", daemon=True)
        self._thread.start()

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Queue one point; returns at once whatever the server's state."""
        with self._wake:
            self._points.append((dict(metrics), step, int(time.time() * 1000)))
            self._wake.notify()

    @property
    def pending(self) -> int:
        return len(self._points)

    def close(self, timeout_s: float) -> list[Point]:
        """Wait up to `timeout_s` for the queue to drain, stop the thread, return what was never sent."""
        deadline = time.monotonic() + timeout_s
        with self._wake:
            while self._points and time.monotonic() < deadline:
                self._wake.wait(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            self._closing = True
            self._wake.notify_all()
        self._thread.join(timeout=max(1.0, self._retry_s * 2))
        with self._wake:
            return list(self._points)

    def _drain(self) -> None:
        down_since: float | None = None
        while True:
            with self._wake:
                while not self._points and not self._closing:
                    self._wake.wait()
                if self._closing:
                    return
                point = self._points[0]
            try:
                self._send(*point)
            except Exception as e:  # noqa: BLE001 - any failure of the tracker is an outage to wait out
                if down_since is None:
                    down_since = time.monotonic()
                    self._say(f"tracking server unreachable ({type(e).__name__}: {str(e)[:200]}); "
                              f"training goes on, metrics queue and are retried every {self._retry_s:g}s")
                with self._wake:
                    if not self._closing:
                        self._wake.wait(timeout=self._retry_s)
                continue
            with self._wake:
                self._points.popleft()
                self._wake.notify_all()
                queued = len(self._points)
            if down_since is not None:
                self._say(f"tracking server reachable again after {time.monotonic() - down_since:.0f}s; "
                          f"sending {queued + 1} queued metric points")
                down_since = None
