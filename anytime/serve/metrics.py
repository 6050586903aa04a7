"""The server's counters in Prometheus' text format (``GET /metrics``), with no client library."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

#: Upper bounds (seconds) of the end-to-end latency histogram's buckets: 0.5 ms to 10 s.
BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Requests, deadline misses, bad requests, end-to-end latency per step (queue + compute), and the drift
    factor, updated from the worker and the HTTP threads (a lock) and rendered on demand."""

    def __init__(self, step_names: Sequence[str]) -> None:
        self._lock = threading.Lock()
        self._steps = tuple(step_names)
        self.requests = 0
        self.misses = 0
        self.promised = 0
        self.broken = 0
        self.expired = 0
        self.bad_requests: dict[int, int] = {}
        self._counts = {name: [0] * len(BUCKETS_S) for name in (*self._steps, "none")}
        self._sums = {name: 0.0 for name in self._counts}
        self._totals = {name: 0 for name in self._counts}
        self.drift = 1.0

    def record(self, answer: Any) -> None:
        """Count one answer (an :class:`anytime.serve.service.Answer`)."""
        seconds = answer.total_ms / 1000.0
        step = answer.step_name or "none"
        with self._lock:
            self.requests += 1
            self.misses += 0 if answer.met else 1
            if answer.fits:
                self.promised += 1
                self.broken += 0 if answer.met else 1
            self.expired += answer.reason == "expired"
            counts = self._counts[step]
            for i, bound in enumerate(BUCKETS_S):
                if seconds <= bound:
                    counts[i] += 1
            self._sums[step] += seconds
            self._totals[step] += 1

    def bad_request(self, status: int) -> None:
        """Count one refused request by its status code."""
        with self._lock:
            self.bad_requests[status] = self.bad_requests.get(status, 0) + 1

    def set_drift(self, factor: float) -> None:
        """The runtime's current drift factor (measured / profiled median latency)."""
        with self._lock:
            self.drift = float(factor)

    def render(self, queue_depth: int) -> str:
        """The Prometheus exposition text."""
        with self._lock:
            lines = [
                "# HELP anytime_requests_total Predictions answered (met or missed).",
                "# TYPE anytime_requests_total counter",
                f"anytime_requests_total {self.requests}",
                "# HELP anytime_deadline_misses_total Answers that came after their deadline (queue time counted).",
                "# TYPE anytime_deadline_misses_total counter",
                f"anytime_deadline_misses_total {self.misses}",
                "# HELP anytime_promised_total Answers the runtime promised on time (an option's price fitted the time left).",
                "# TYPE anytime_promised_total counter",
                f"anytime_promised_total {self.promised}",
                "# HELP anytime_promises_broken_total Promised answers that came after their deadline.",
                "# TYPE anytime_promises_broken_total counter",
                f"anytime_promises_broken_total {self.broken}",
                "# HELP anytime_expired_total Requests whose deadline passed while they queued.",
                "# TYPE anytime_expired_total counter",
                f"anytime_expired_total {self.expired}",
                "# HELP anytime_bad_requests_total Requests answered with an error, by status code (4xx refused, 5xx failed).",
                "# TYPE anytime_bad_requests_total counter",
                *(f'anytime_bad_requests_total{{code="{code}"}} {n}' for code, n in sorted(self.bad_requests.items())),
                "# HELP anytime_request_seconds End-to-end latency (queue + compute) by the step that answered.",
                "# TYPE anytime_request_seconds histogram",
            ]
            for step, counts in self._counts.items():
                if not self._totals[step] and step == "none":
                    continue
                name = _label(step)
                lines += [
                    f'anytime_request_seconds_bucket{{step="{name}",le="{b:g}"}} {n}' for b, n in zip(BUCKETS_S, counts)
                ]
                lines += [f'anytime_request_seconds_bucket{{step="{name}",le="+Inf"}} {self._totals[step]}',
                          f'anytime_request_seconds_sum{{step="{name}"}} {self._sums[step]:.6f}',
                          f'anytime_request_seconds_count{{step="{name}"}} {self._totals[step]}']  # fmt: skip
            lines += [
                "# HELP anytime_drift_factor Measured over profiled median latency (1: as profiled).",
                "# TYPE anytime_drift_factor gauge",
                f"anytime_drift_factor {self.drift:.6f}",
                "# HELP anytime_queue_depth Requests waiting for the worker.",
                "# TYPE anytime_queue_depth gauge",
                f"anytime_queue_depth {queue_depth}",
            ]
        return "\n".join(lines) + "\n"
