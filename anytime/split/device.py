"""The device's half of split computing (``anytime split-run``): run the local segments with their exits, send
the activation when no local exit is confident, and follow the link it measures.

Each answer says where it came from (``device``, ``server``, or ``fallback`` when the server could not be used:
then the best answer the device can give within what is left of the deadline, and why), its exit, its bytes and
its time split into device, wire and server. After every transfer the device updates its estimate of the
bandwidth; when it moves by more than ``replan_change`` the plan is made again for the link it now sees, so a
link that slows down moves the partition toward the device or the answer to a local exit. A plan that sends
nothing learns nothing of the link, so every ``probe_every`` such requests the device sends a probe between
requests (never inside one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from anytime.calibrate import ExitPolicy
from anytime.split.codec import encode, payload_bytes
from anytime.split.link import LinkError, LinkEstimator, SplitClient
from anytime.split.plan import Link, SplitPlan, SplitPlanner

PROBE_BYTES = 16 * 1024


@dataclass(frozen=True)
class SplitAnswer:
    """One request's outcome: ``where`` it was answered (device, server, fallback), the class, the exit, the
    plan's partition and codec, bytes sent, and milliseconds end to end and per part."""

    prediction: int
    exit: int
    where: str
    partition: int
    codec: str
    sent_bytes: int
    total_ms: float
    device_ms: float
    network_ms: float
    server_ms: float
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return asdict(self)


class SplitDevice:
    """Answers inputs one at a time under a :class:`SplitPlan`, re-planning as the measured link moves."""

    def __init__(self, model: Any, planner: SplitPlanner, client: SplitClient, *, deadline_ms: float,
                 quantile: float = 0.99, link: Link, adapt: bool = True, replan_change: float = 0.2,
                 probe_every: int = 25, clock: Callable[[], float] = time.perf_counter) -> None:  # fmt: skip
        self.model = model
        self.segments = tuple(model.segments)
        self.heads = list(model.heads)
        self.planner = planner
        self.client = client
        self.deadline_ms = deadline_ms
        self.quantile = quantile
        self.adapt = adapt
        self.replan_change = replan_change
        self.probe_every = probe_every
        self._clock = clock
        self.estimator = LinkEstimator(link, quantile=quantile)
        self.plan: SplitPlan = planner.plan(link, deadline_ms, quantile)
        self.policy: ExitPolicy = self.plan.option.policy
        self.replans: list[tuple[int, SplitPlan]] = []
        self.answered = 0
        self._since_sent = 0
        self._fallback_ms = planner.device_path_ms(0.9)

    def ping(self, count: int = 3) -> float:
        """Measure the round trip (lowest of ``count`` pings) and re-plan for it; raises LinkError when unreachable."""
        replies = [self.client.request({"type": "ping"}) for _ in range(count)]
        best = min(replies, key=lambda r: r.round_trip_ms)
        self.estimator.ping(best.round_trip_ms, best.sent_bytes + best.received_bytes)
        self._replan_if_moved(force=True)
        return self.estimator.rtt_ms

    def measure_link(self, x: Any, count: int) -> Link:
        """Send ``x`` to the server ``count`` times (the input, as a server-only plan sends it, in turn in the
        smallest and the largest codec planned, so that the fixed cost of an exchange and its cost per byte can be
        told apart) and learn the link from the exchanges; then plan again. Raises LinkError when the server cannot
        be used."""
        import torch

        by_size = sorted(self.planner.codecs, key=lambda c: payload_bytes(tuple(x.shape[1:]), c))
        codecs = (by_size[0], by_size[-1])
        thresholds = [None] * (len(self.segments) - 1)
        exchanges = []
        for i in range(count):
            begin = self._clock()
            with torch.inference_mode():
                fields, payload = encode(x, codecs[i % 2])
            header = {"type": "infer", "id": -1, "partition": -1, **fields, "criterion": self.policy.criterion,
                      "thresholds": thresholds}  # fmt: skip
            reply = self.client.request(header, payload)
            exchanges.append((reply.sent_bytes + reply.received_bytes, (self._clock() - begin) * 1000,
                              float(reply.header.get("compute_ms", 0.0))))  # fmt: skip
        self.estimator.calibrate(exchanges)
        self._replan_if_moved(force=True)
        return self.estimator.link

    def _replan_if_moved(self, *, force: bool = False) -> None:
        seen, planned = self.estimator.link, self.plan.link
        ratio = seen.bandwidth_mbps / planned.bandwidth_mbps
        moved = (
            abs(ratio - 1) > self.replan_change
            or abs(seen.rtt_ms - planned.rtt_ms) > 0.2 * max(planned.rtt_ms, 1)
            or abs(seen.overhead_ms - planned.overhead_ms) > self.replan_change * max(planned.overhead_ms, 1)
        )
        if force or (self.adapt and moved):
            before = self.plan.option
            self.plan = self.planner.plan(seen, self.deadline_ms, self.quantile)
            self.policy = self.plan.option.policy
            after = self.plan.option
            if (after.partition, after.codec, after.thresholds) != (before.partition, before.codec, before.thresholds):
                self.replans.append((self.answered, self.plan))

    def answer(self, x: Any) -> SplitAnswer:
        """One input ``[1, ...]`` end to end."""
        import torch

        start = self._clock()
        option = self.plan.option
        k = option.partition
        last = len(self.segments) - 1
        h = x
        with torch.inference_mode():
            for j in range(min(k, last) + 1):
                h = self.segments[j](h)
                if j == last:
                    return self._done(int(h.argmax(dim=1)), j, "device", 0, start, self._clock(), 0.0, 0.0)
                if self.policy.thresholds[j] is None:
                    continue
                logits = self.heads[j](h)
                if self.policy.leaves(j, logits):
                    return self._done(int(logits.argmax(dim=1)), j, "device", 0, start, self._clock(), 0.0, 0.0)
            local_done = self._clock()
            fields, payload = encode(h, option.codec)
            header = {"type": "infer", "id": self.answered, "partition": k, **fields,
                      "criterion": self.policy.criterion, "thresholds": list(self.policy.thresholds)}  # fmt: skip
            try:
                reply = self.client.request(header, payload)
            except LinkError as exc:
                return self._fallback(h, k, start, str(exc))
            end = self._clock()
            server_ms = float(reply.header.get("compute_ms", 0.0))
            exchange_ms = (end - local_done) * 1000
            self._since_sent = 0
            self.estimator.transfer(reply.sent_bytes + reply.received_bytes, exchange_ms, server_ms)
            done = self._done(int(reply.header["prediction"][0]), int(reply.header["exit"][0]), "server",
                              reply.sent_bytes, start, end, exchange_ms - server_ms, server_ms,
                              device_ms=(local_done - start) * 1000)  # fmt: skip
        self._replan_if_moved()
        return done

    def _fallback(self, h: Any, k: int, start: float, why: str) -> SplitAnswer:
        """The best local answer when the server cannot help: continue on the device from where it stopped, as
        deep as the deadline's remainder allows (the device profile's p90 per exit), at least one exit."""
        last = len(self.segments) - 1
        left = self.deadline_ms - (self._clock() - start) * 1000
        j = max(k, 0)
        if k < 0:
            h = self.segments[0](h)
        reach = max([j] + [e for e in range(j, last + 1) if self._fallback_ms[e] - self._fallback_ms[j] <= left])
        for e in range(j + 1, reach + 1):
            h = self.segments[e](h)
        logits = h if reach == last else self.heads[reach](h)
        return self._done(int(logits.argmax(dim=1)), reach, "fallback", 0, start, self._clock(), 0.0, 0.0,
                          note=f"{why}; answered on the device at exit {reach}")  # fmt: skip

    def _done(self, prediction: int, exit_: int, where: str, sent: int, start: float, end: float, network_ms: float,
              server_ms: float, *, device_ms: float | None = None, note: str | None = None) -> SplitAnswer:  # fmt: skip
        total = (end - start) * 1000
        self.answered += 1
        if where != "server":
            self._since_sent += 1
        option = self.plan.option
        return SplitAnswer(prediction, exit_, where, option.partition, option.codec, sent, total,
                           total if device_ms is None else device_ms, network_ms, server_ms, note)  # fmt: skip

    def maybe_probe(self) -> bool:
        """Between requests: after ``probe_every`` answers that sent nothing, send a probe to measure the link
        (so that a link that recovers is seen); True if a probe was sent and answered."""
        if not self.adapt or self._since_sent < self.probe_every:
            return False
        self._since_sent = 0
        try:
            reply = self.client.request({"type": "probe"}, bytes(PROBE_BYTES))
        except LinkError:
            return False
        self.estimator.transfer(reply.sent_bytes + reply.received_bytes, reply.round_trip_ms, 0.0)
        self._replan_if_moved()
        return True
