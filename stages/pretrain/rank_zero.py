"""The one place the pretraining workers have side effects: prints and MLflow metrics, on world rank 0 only.

Metrics go through a `MetricBuffer` (`core.metric_buffer`): a tracking server that is down costs no training step
(the points queue and arrive, in order, when it is back), and one still down at the end is reported, not a failure.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from core.metric_buffer import MetricBuffer

METRICS_DRAIN_S = 300.0
"""How long the end of training waits for metrics queued during a tracking outage before reporting them lost."""


class RankZero:
    """One worker's prints and metrics: those of world rank 0 happen, the other ranks' are dropped."""

    def __init__(self, rank: int, tracker: Any):
        self.rank, self.tracker, self.started = rank, tracker, time.time()
        self.buffer = MetricBuffer(self._send, say=self.print) if rank == 0 else None
        self.unsent = 0

    def _send(self, metrics: dict[str, float], step: int, timestamp_ms: int) -> None:
        self.tracker.log_metrics(metrics, step=step, timestamp_ms=timestamp_ms)

    def print(self, message: str) -> None:
        if self.rank == 0:
            # Not print(): Ray Train routes print() through the root logger, which DeepSpeed's handler
            # echoes a second time, so every line would reach the driver twice.
            sys.stdout.write(f"[pretrain {time.time() - self.started:5.0f}s] {message}\n")
            sys.stdout.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self.buffer is not None:
            self.buffer.log({k: v for k, v in metrics.items() if v is not None}, step=step)

    def close(self, timeout_s: float = METRICS_DRAIN_S) -> int:
        """Deliver what is queued (waiting up to `timeout_s`); returns the number of points never delivered."""
        if self.buffer is not None:
            left = self.buffer.close(timeout_s)
            self.buffer, self.unsent = None, len(left)
            if left:
                self.print(f"warning: {len(left)} metric points (steps {left[0][1]}-{left[-1][1]}) could not be "
                           f"logged: the tracking server was still unreachable after {timeout_s:.0f}s")
        return self.unsent
