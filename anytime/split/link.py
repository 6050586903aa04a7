"""The wire between the device and the server: framed messages over TCP, a shaped link on the device side, and
an estimate of the link the device actually gets.

A frame is two big-endian 32-bit lengths (header, payload), a UTF-8 JSON header and the payload bytes. The
device sends ``{"type": "infer", "partition", "codec", "shape", "criterion", "thresholds"}`` with the encoded
activation, ``{"type": "ping"}`` to measure the round trip, or ``{"type": "probe"}`` with filler bytes to measure
the bandwidth; the server answers ``{"ok": true, ...}`` or ``{"ok": false, "error": "one sentence"}``.

:class:`LinkShaper` makes one machine's loopback behave like a slower network: a token bucket paces the bytes
sent at the bandwidth, and half the added round trip is waited before sending, half after the reply.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from anytime.errors import AnytimeError
from anytime.profile.stats import quantile_of
from anytime.scheduler.online import SortedWindow
from anytime.split.plan import Link
from anytime.utils.jsonsafe import loads_bounded

PREFIX = struct.Struct(">II")
MAX_HEADER = 64 * 1024
CHUNK = 16 * 1024  # bytes the shaper paces at a time (fewer, longer waits: a sleep overshoots by tens of us)


class LinkError(AnytimeError):
    """The server could not be reached, did not answer in time, hung up, or answered something malformed."""


def frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    """One message on the wire."""
    head = json.dumps(header, separators=(",", ":")).encode()
    return PREFIX.pack(len(head), len(payload)) + head + payload


def _read_exact(sock: socket.socket, count: int) -> bytes:
    chunks, left = [], count
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise ConnectionError("the connection closed")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_frame(sock: socket.socket, max_payload: int) -> tuple[dict[str, Any], bytes]:
    """The next message; ``ValueError`` with one sentence for a malformed or oversized one, ``ConnectionError``
    when the peer hangs up."""
    head_len, payload_len = PREFIX.unpack(_read_exact(sock, PREFIX.size))
    if head_len > MAX_HEADER:
        raise ValueError(f"a header of {head_len} bytes is over the {MAX_HEADER}-byte limit")
    if payload_len > max_payload:
        raise ValueError(f"a payload of {payload_len} bytes is over the server's {max_payload}-byte limit")
    try:
        header = loads_bounded(_read_exact(sock, head_len))
    except ValueError as exc:
        raise ValueError(f"the header: {exc}") from None
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header, _read_exact(sock, payload_len)


class TokenBucket:
    """Paces bytes at ``rate`` bytes/s with bursts of up to ``burst`` bytes; ``clock`` and ``sleep`` are
    injectable so tests drive it without waiting."""

    def __init__(self, rate: float, burst: int = CHUNK, *, clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        if not rate > 0:
            raise AnytimeError(f"a token bucket needs a positive rate (got {rate})")
        self.rate = float(rate)
        self.burst = int(burst)
        self._clock, self._sleep = clock, sleep
        self._tokens = float(burst)
        self._last = clock()

    def consume(self, count: int) -> None:
        """Wait until ``count`` bytes may go. The debt is paid by waiting and the wait is credited at the next
        call from the clock, so a sleep that overshoots does not slow the link below its rate."""
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
        self._last = now
        self._tokens -= count
        if self._tokens < 0:
            self._sleep(-self._tokens / self.rate)


class LinkShaper:
    """The device's side of an emulated link: ``bandwidth_mbps`` (None: as fast as the socket goes), paced by a
    token bucket without burst, and an added round trip ``delay_ms``. :meth:`set_bandwidth` changes it between
    requests (an experiment's link slowing down)."""

    def __init__(self, bandwidth_mbps: float | None = None, delay_ms: float = 0.0, *,
                 clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        if not (math.isfinite(delay_ms) and delay_ms >= 0):
            raise AnytimeError(f"the added delay must be a number of milliseconds >= 0 (got {delay_ms})")
        self.delay_ms = float(delay_ms)
        self._clock, self._sleep = clock, sleep
        self.bucket: TokenBucket | None = None
        self.bandwidth_mbps: float | None = None
        self.set_bandwidth(bandwidth_mbps)

    def set_bandwidth(self, bandwidth_mbps: float | None) -> None:
        """Pace at ``bandwidth_mbps`` from now on (None: unshaped)."""
        if bandwidth_mbps is not None:
            Link(bandwidth_mbps, 0.0)  # validates
        self.bandwidth_mbps = None if bandwidth_mbps is None else float(bandwidth_mbps)
        # No burst: every byte waits its time at the bandwidth, as on a link of that rate (a burst allowance
        # would let a small message through an idle link at no cost at all).
        self.bucket = None if bandwidth_mbps is None else TokenBucket(
            bandwidth_mbps * 1e6 / 8, burst=0, clock=self._clock, sleep=self._sleep)  # fmt: skip

    def send(self, sock: socket.socket, data: bytes) -> None:
        """Half the added delay, then ``data`` paced through the bucket."""
        if self.delay_ms:
            self._sleep(self.delay_ms / 2000)
        if self.bucket is None:
            sock.sendall(data)
            return
        view = memoryview(data)
        for start in range(0, len(view), CHUNK):
            piece = view[start : start + CHUNK]
            self.bucket.consume(len(piece))
            sock.sendall(piece)

    def received(self, count: int) -> None:
        """The reply's way back: its bytes at the bandwidth and the other half of the delay."""
        if self.bucket is not None:
            self.bucket.consume(count)
        if self.delay_ms:
            self._sleep(self.delay_ms / 2000)


@dataclass(frozen=True)
class Reply:
    """The server's answer and how long the exchange took: ``round_trip_ms`` from the first byte sent to the
    last received, ``sent_bytes`` and ``received_bytes`` on the wire."""

    header: dict[str, Any]
    round_trip_ms: float
    sent_bytes: int
    received_bytes: int


class SplitClient:
    """The device's connection to the server: one request at a time, with timeouts. Any failure (refused,
    timed out, hung up, malformed) raises :class:`LinkError` and drops the connection; after a failure to
    connect, requests fail at once for ``retry_after_s`` rather than wait on a dead server every time."""

    def __init__(self, host: str, port: int, *, timeout_s: float = 2.0, shaper: LinkShaper | None = None,
                 retry_after_s: float = 1.0, clock: Callable[[], float] = time.perf_counter,
                 max_reply: int = 1 << 20) -> None:  # fmt: skip
        if not timeout_s > 0:
            raise AnytimeError(f"the server timeout must be positive (got {timeout_s} s)")
        self.host, self.port = host, int(port)
        self.timeout_s = float(timeout_s)
        self.shaper = shaper or LinkShaper()
        self.retry_after_s = retry_after_s
        self._clock = clock
        self._sock: socket.socket | None = None
        self._down_until = -math.inf
        self.max_reply = max_reply

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    def _connect(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        if self._clock() < self._down_until:
            raise LinkError(f"the server at {self.address} was unreachable moments ago")
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
        except OSError as exc:
            self._down_until = self._clock() + self.retry_after_s
            raise LinkError(
                f"the server at {self.address} is unreachable ({exc.strerror or type(exc).__name__})"
            ) from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(self.timeout_s)
        self._sock = sock
        return sock

    def close(self) -> None:
        """Drop the connection."""
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def request(self, header: dict[str, Any], payload: bytes = b"") -> Reply:
        """Send one message and wait for its answer; a refusal by the server (``ok: false``) is a
        :class:`LinkError` carrying the server's sentence."""
        sock = self._connect()
        data = frame(header, payload)
        start = self._clock()
        try:
            self.shaper.send(sock, data)
            reply, extra = read_frame(sock, self.max_reply)
        except (OSError, ConnectionError, ValueError, struct.error) as exc:
            self.close()
            what = "did not answer in time" if isinstance(exc, socket.timeout) else f"failed ({exc})"
            raise LinkError(f"the server at {self.address} {what}") from None
        received = PREFIX.size + len(json.dumps(reply, separators=(",", ":"))) + len(extra)
        self.shaper.received(received)
        elapsed = (self._clock() - start) * 1000
        if reply.get("ok") is not True:
            raise LinkError(f"the server refused the request: {reply.get('error', 'no reason given')}")
        return Reply(reply, elapsed, len(data), received)


class LinkEstimator:
    """What the device learns of its link from its own exchanges: the round trip from pings (the lowest seen,
    slowly forgotten); the bandwidth from transfers (the time beyond the round trip, the server's compute and a
    fixed cost per exchange, an exponential average of milliseconds per byte); and the overhead: the fixed cost
    plus the ``quantile`` of what the last ``window`` exchanges took beyond all that (encoding, framing, the waits of
    the OS and of a shaped link: a deadline at p99 is missed in that tail, not in the average). The fixed cost is
    fit by :meth:`calibrate` from exchanges of two sizes; without it, it is spread over the bytes. The overhead
    counts once ``min_observations`` exchanges are in. The average moves toward the median of the last three
    transfers, so that one stall shows in the overhead and not as a slower link; it follows a slower link faster
    (``slowing``) than a faster one (``speeding``): a deadline is missed by trusting a link that has slowed, not the
    reverse."""

    def __init__(self, assumed: Link, *, slowing: float = 0.6, speeding: float = 0.15, quantile: float = 0.99,
                 window: int = 200, min_observations: int = 20) -> None:  # fmt: skip
        if not 0 < quantile < 1 or window < 1 or not 1 <= min_observations <= window:
            raise AnytimeError(f"need 0 < quantile < 1 and 1 <= min_observations <= window (got {quantile}, "
                               f"{min_observations}, {window})")  # fmt: skip
        self.rtt_ms = float(assumed.rtt_ms)
        self._ms_per_byte = 8 / (1000 * assumed.bandwidth_mbps)
        self._assumed_overhead = float(assumed.overhead_ms)
        self.fixed_ms = 0.0
        self.slowing, self.speeding = slowing, speeding
        self.quantile, self.min_observations = quantile, min_observations
        self._residuals = SortedWindow(window)
        self._recent: deque[float] = deque(maxlen=3)  # the average follows their median: one stall is not a slower link
        self.observed = 0
        self._pinged = False

    @property
    def overhead_ms(self) -> float:
        """The exchange's time beyond the round trip and its bytes at the quantile: the fixed cost and the tail (the
        assumed link's until enough exchanges are in)."""
        if len(self._residuals) < self.min_observations:
            return self._assumed_overhead
        return self.fixed_ms + max(0.0, self._residuals.quantile(self.quantile))

    @property
    def link(self) -> Link:
        """The current estimate."""
        return Link(8 / (1000 * self._ms_per_byte), self.rtt_ms, self.overhead_ms)

    def ping(self, round_trip_ms: float, nbytes: int = 0) -> None:
        """A ping's round trip, ``nbytes`` on the wire both ways (their time at the bandwidth believed now is not
        the round trip's)."""
        round_trip_ms = max(0.0, round_trip_ms - nbytes * self._ms_per_byte)
        self.rtt_ms = round_trip_ms if not self._pinged else min(round_trip_ms, 0.9 * self.rtt_ms + 0.1 * round_trip_ms)
        self._pinged = True

    def calibrate(self, exchanges: Sequence[tuple[int, float, float]]) -> None:
        """Learn the link from ``(bytes, round_trip_ms, server_ms)`` of exchanges in a row: with two or more sizes,
        the fixed cost and the cost per byte through the medians of the smallest and the largest size; with one
        size (or a fit that is not a positive cost per byte), the median cost per byte and no fixed cost. Then
        every exchange is counted as a transfer, its residual against that fit."""
        wires = [(n, rt - srv - self.rtt_ms) for n, rt, srv in exchanges if n > 0 and math.isfinite(rt - srv)]
        if not wires:
            return
        sizes = sorted({n for n, _ in wires})
        fitted = False
        if len(sizes) >= 2:
            small = _median([w for n, w in wires if n == sizes[0]])
            per_byte = (_median([w for n, w in wires if n == sizes[-1]]) - small) / (sizes[-1] - sizes[0])
            if per_byte > 0:
                self._ms_per_byte, self.fixed_ms, fitted = per_byte, max(0.0, small - per_byte * sizes[0]), True
        if not fitted:
            per_byte = _median([w / n for n, w in wires if w > 0] or [self._ms_per_byte])
            self._ms_per_byte, self.fixed_ms = per_byte, 0.0
        self._recent.clear()
        for nbytes, round_trip_ms, server_ms in exchanges:
            self.transfer(nbytes, round_trip_ms, server_ms)

    def transfer(self, nbytes: int, round_trip_ms: float, server_ms: float) -> None:
        """A request that carried ``nbytes`` (both ways) and took ``round_trip_ms`` from the end of the device's
        compute to the answer, ``server_ms`` of it computing on the server."""
        wire = round_trip_ms - server_ms - self.rtt_ms - self.fixed_ms
        if nbytes <= 0 or not math.isfinite(wire):
            return
        self._residuals.add(wire - nbytes * self._ms_per_byte)
        if wire <= 0:
            return
        self._recent.append(wire / nbytes)
        seen = sorted(self._recent)[len(self._recent) // 2]
        self._ms_per_byte += (self.slowing if seen > self._ms_per_byte else self.speeding) * (seen - self._ms_per_byte)
        self.observed += 1


def _median(values: list[float]) -> float:
    return quantile_of(np.asarray(values), 0.5)
