"""The metric buffer keeps training's points through an outage and delivers them in order once it ends."""

from __future__ import annotations

import threading
import time

from core.metric_buffer import MetricBuffer


class FlakyStore:
    """A store that refuses every write until `up` is set, like a stopped server."""

    def __init__(self):
        self.up = threading.Event()
        self.rows: list[tuple[int, float, int]] = []

    def send(self, metrics, step, ts):
        if not self.up.is_set():
            raise ConnectionError("connection refused")
        self.rows.append((step, metrics["loss"], ts))


def test_outage_costs_no_point_and_keeps_order():
    store, said = FlakyStore(), []
    buf = MetricBuffer(store.send, retry_s=0.05, say=said.append)
    started = time.monotonic()
    for step in range(1, 201):
        buf.log({"loss": 1.0 / step}, step)
    assert time.monotonic() - started < 1.0  # logging never waited on the dead store
    time.sleep(0.2)
    assert store.rows == [] and buf.pending == 200
    store.up.set()
    assert buf.close(timeout_s=10) == []
    assert [r[0] for r in store.rows] == list(range(1, 201))
    stamps = [r[2] for r in store.rows]
    assert stamps == sorted(stamps) and stamps[-1] - stamps[0] < 1000  # measured times, not delivery times
    assert "unreachable" in said[0] and "reachable again" in said[1] and len(said) == 2


def test_close_returns_what_could_not_be_sent():
    store = FlakyStore()
    buf = MetricBuffer(store.send, retry_s=0.05, say=lambda _: None)
    buf.log({"loss": 2.0}, 1)
    buf.log({"loss": 1.0}, 2)
    left = buf.close(timeout_s=0.3)
    assert [(m["loss"], step) for m, step, _ in left] == [(2.0, 1), (1.0, 2)]
