"""Split computing with early exit: which partition point, codec and exit thresholds answer most accurately
within a deadline, given the device's profile, the server's profile and the link.

A *partition* ``k`` runs segments 0..k on the device (exits 0..k there: DDNN's local exits) and sends the
activation after segment ``k`` to the server, which runs the rest (and may leave at its own exits). ``k = -1``
sends the input (server only); ``k = K-1`` sends nothing (device only). A sample that leaves at exit ``j`` costs

- ``j <= k``: the device's path to exit j (its profile's cumulative stages, per repetition);
- ``j > k``: the device's path to exit k, the link (round trip, bytes over bandwidth and the exchange's
  overhead: :class:`Link`), and the server's stages k+1..j: timed from a stored activation where the server's
  profile has them (``anytime profile --suffixes``), else read off its full passes. The two machines' samples are
  independent, so every pair of repetitions is one possible request.

A request's latency is then a mixture over exits, weighted by where the validation samples leave under the
option's thresholds (computed from the validation logits, with exits after ``k`` recomputed from the compressed
activation, see :mod:`anytime.split.tables`). Each option's quantile is read from the mixture's CDF on a grid.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from anytime.calibrate import ExitPolicy
from anytime.calibrate.criteria import get_criterion
from anytime.calibrate.sweeps import Scores, evaluate_settings, scores_of, shared_grid, to_natural
from anytime.errors import AnytimeError
from anytime.profile.stats import quantile_of
from anytime.profile.store import DeviceProfile
from anytime.scheduler.deadline import check_deadline
from anytime.split.codec import payload_bytes
from anytime.split.tables import SplitTables

HEADER_BYTES = 256  # a request's framed JSON header and the server's framed reply, about (anytime.split.link)
GRID_POINTS = 2048  # latency grid a mixture's CDF is read on
SHARED_VALUES = 48  # shared thresholds tried per subset of enabled exits
MAX_SUBSETS = 128  # beyond this many subsets of early exits, only all, single and pairs of exits are tried


@dataclass(frozen=True)
class Link:
    """The network between device and server: bandwidth (Mbit/s, both ways), round-trip time (ms) and
    ``overhead_ms``, what one exchange takes beyond those two at the planning quantile: encoding and decoding
    the activation, framing, and the waits of the operating system and of a shaped link (``anytime split-run``
    measures it before it plans)."""

    bandwidth_mbps: float
    rtt_ms: float
    overhead_ms: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.bandwidth_mbps, bool) or not (0 < float(self.bandwidth_mbps) < math.inf):
            raise AnytimeError(f"bandwidth {self.bandwidth_mbps!r} Mbit/s is not a positive number")
        if isinstance(self.rtt_ms, bool) or not (0 <= float(self.rtt_ms) < math.inf):
            raise AnytimeError(f"round-trip time {self.rtt_ms!r} ms is not a number of milliseconds >= 0")
        if isinstance(self.overhead_ms, bool) or not (0 <= float(self.overhead_ms) < math.inf):
            raise AnytimeError(f"link overhead {self.overhead_ms!r} ms is not a number of milliseconds >= 0")

    def transfer_ms(self, nbytes: float) -> float:
        """One request's time on the link: the round trip, ``nbytes`` at the bandwidth and the overhead."""
        return float(self.rtt_ms) + 8 * float(nbytes) / (1000 * float(self.bandwidth_mbps)) + float(self.overhead_ms)


@dataclass(frozen=True)
class PlanSettings:
    """What a split plan considers (:func:`anytime.split.runs.plan_run`, ``anytime split-run``): ``quantile``, the
    share of requests whose latency must fit the deadline (0.99: the p99); ``codecs``, how an activation may travel
    (fp32, fp16, int8); ``criterion``, the exit criterion its thresholds are set on; ``partitions``, the partition
    points it may choose, as :func:`anytime.split.runs.parse_partitions` reads them (``server,1,device``; None:
    every one)."""

    quantile: float = 0.99
    codecs: tuple[str, ...] = ("fp32", "fp16", "int8")
    criterion: str = "entropy"
    partitions: str | None = None


@dataclass(frozen=True)
class SplitOption:
    """One way to answer: partition, codec, exit thresholds (criterion's units; None: nobody leaves there),
    expected validation accuracy, latency at the quantile, the share answered on the device and bytes per request."""

    partition: int
    codec: str
    criterion: str
    thresholds: tuple[float | None, ...]
    accuracy: float
    latency_ms: float
    device_share: float
    bytes_per_request: float
    exit_share: tuple[float, ...]

    @property
    def policy(self) -> ExitPolicy:
        """The exit policy both machines apply (the device its exits 0..partition, the server the rest)."""
        return ExitPolicy(self.criterion, self.thresholds)

    def name(self, num_steps: int) -> str:
        """``device only``, ``server only (fp16)``, ``after exit 1 (int8)``."""
        if self.partition >= num_steps - 1:
            return "device only"
        if self.partition < 0:
            return f"server only ({self.codec})"
        return f"after exit {self.partition} ({self.codec})"

    def to_dict(self, num_steps: int) -> dict[str, Any]:
        """JSON-able."""
        return {"name": self.name(num_steps), "partition": self.partition, "codec": self.codec,
                "criterion": self.criterion, "thresholds": list(self.thresholds), "accuracy": self.accuracy,
                "latency_ms": self.latency_ms, "device_share": self.device_share,
                "bytes_per_request": self.bytes_per_request, "exit_share": list(self.exit_share)}  # fmt: skip


@dataclass(frozen=True)
class SplitPlan:
    """The planner's answer: the option chosen for the deadline, whether it fits, and the frontier it came from."""

    option: SplitOption
    fits: bool
    deadline_ms: float
    quantile: float
    link: Link
    frontier: tuple[SplitOption, ...]
    num_steps: int
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: the choice first, then the frontier (cheapest first)."""
        return {**self.option.to_dict(self.num_steps), "fits": self.fits, "deadline_ms": self.deadline_ms,
                "quantile": self.quantile, "bandwidth_mbps": self.link.bandwidth_mbps, "rtt_ms": self.link.rtt_ms,
                "link_overhead_ms": self.link.overhead_ms,
                "note": self.note, "frontier": [o.to_dict(self.num_steps) for o in self.frontier]}  # fmt: skip


@dataclass(frozen=True)
class _Candidates:
    """Every threshold setting of one (partition, codec): validation accuracy and exit shares."""

    partition: int
    codec: str
    signed: Tensor  # [S, K-1]
    accuracy: np.ndarray  # [S]
    share: np.ndarray  # [S, K]
    natural: np.ndarray  # [S, K-1], NaN: nobody leaves


def check_profile_pair(device: DeviceProfile, server: DeviceProfile, *, fingerprint: str | None, num_steps: int,
                       where: tuple[str, str] = ("device profile", "server profile")) -> None:  # fmt: skip
    """Refuse profiles of another model, of each other's other model, without stage latencies or at batch 1."""
    if device.model_fingerprint != server.model_fingerprint:
        raise AnytimeError(
            f"the {where[0]} (weights {device.model_fingerprint}) and the {where[1]} (weights "
            f"{server.model_fingerprint}) were measured on different models; profile the same run on both machines"
        )
    for profile, name in ((device, where[0]), (server, where[1])):
        profile.check_model(fingerprint, num_steps, where=name)
        if not profile.incremental or profile.at(1).stages is None:
            raise AnytimeError(f"the {name} has no stage latencies: split computing needs an incremental run "
                               "(exits or an ensemble) profiled at batch size 1")  # fmt: skip


class SplitPlanner:
    """Plans (partition, codec, thresholds) for a link and a deadline from two profiles and the validation tables.

    Accuracy and exit shares of every setting are computed once (they do not depend on the link); each
    :meth:`plan` only prices the settings for the link asked, so a device can re-plan whenever its estimate of
    the bandwidth moves.
    """

    def __init__(self, tables: SplitTables, device: DeviceProfile, server: DeviceProfile, *,
                 criterion: str = "entropy", codecs: Sequence[str] | None = None,
                 partitions: Sequence[int] | None = None) -> None:  # fmt: skip
        self.tables = tables
        self.device = device
        self.server = server
        if get_criterion(criterion).learned:
            raise AnytimeError("split computing plans its thresholds with a hand-made criterion (entropy, "
                               "normalized-entropy, confidence, margin, patience), not with learned gates yet")  # fmt: skip
        self.criterion = get_criterion(criterion).name
        self.num_steps = tables.num_steps
        check_profile_pair(device, server, fingerprint=tables.model_fingerprint, num_steps=self.num_steps)
        codecs = tuple(codecs or tables.codecs)
        missing = [c for c in codecs if c not in tables.codecs]
        if missing:
            raise AnytimeError(f"the split tables hold codecs {', '.join(tables.codecs)}, not {', '.join(missing)}; "
                               "build them again with those codecs")  # fmt: skip
        last = self.num_steps - 1
        chosen = range(-1, last + 1) if partitions is None else sorted(set(partitions))
        for k in chosen:
            if not -1 <= k <= last:
                raise AnytimeError(f"partition {k} does not exist; this run has partitions -1 (server only) to {last} "
                                   "(device only)")  # fmt: skip
        self.codecs = codecs
        self._candidates: list[_Candidates] = []
        grid = _settings(scores_of(tables.cache, self.criterion))
        for k in chosen:
            for codec in ("fp32",) if k == last else codecs:
                scores = scores_of(tables.cache_for(k, codec), self.criterion)
                acc, _, share = evaluate_settings(scores, grid, floor_disables=False)
                natural = to_natural(
                    scores.criterion, grid, tables.num_classes, torch.full((last,), -math.inf, dtype=torch.float64)
                )
                natural[torch.isinf(grid).numpy()] = np.nan
                self._candidates.append(_Candidates(k, codec, grid, acc.numpy(), share.numpy(), natural))
        dev, srv = device.at(1).stages, server.at(1).stages
        assert dev is not None and srv is not None
        self._device_paths = np.cumsum(np.stack(dev), axis=0)  # [K, R]
        self._server_paths = np.cumsum(np.stack(srv), axis=0)
        # Per (partition, exit): the sorted latencies of a request leaving there, the link's time left out (it only
        # shifts them), computed once so that re-planning for a new link costs no sorting.
        self._paths: dict[tuple[int, int], np.ndarray] = {}
        for k in sorted({c.partition for c in self._candidates}):
            for j in range(self.num_steps):
                if j <= k:
                    self._paths[(k, j)] = np.sort(self._device_paths[j])
                    continue
                suffix = server.at(1).suffix_paths(k) if k >= 0 else None
                if suffix is not None:  # measured from a received activation, as the server runs it
                    remote = suffix[j - k - 1]
                else:  # read off one full pass: segments started cold run slower than this
                    remote = self._server_paths[j] - (self._server_paths[k] if k >= 0 else 0)
                local = np.zeros(1) if k < 0 else self._device_paths[k]
                self._paths[(k, j)] = np.sort((local[:, None] + remote[None, :]).reshape(-1))

    def device_path_ms(self, quantile: float) -> list[float]:
        """Per exit, the device's time to reach it at ``quantile`` (ms)."""
        return [quantile_of(p, quantile) for p in self._device_paths]

    def _components(self, k: int, codec: str, link: Link) -> list[np.ndarray]:
        """Per exit j, the sorted latency samples of a request that leaves there under partition k."""
        last = self.num_steps - 1
        sent = 0.0 if k >= last else link.transfer_ms(payload_bytes(self.tables.shape_at(k), codec) + HEADER_BYTES)
        return [self._paths[(k, j)] + (sent if j > k else 0.0) for j in range(self.num_steps)]

    def options(self, link: Link, quantile: float = 0.99) -> list[SplitOption]:
        """Every candidate priced for ``link`` at ``quantile``."""
        q = min(self.device.check_quantile(quantile), self.server.check_quantile(quantile))
        result = []
        for cand in self._candidates:
            parts = self._components(cand.partition, cand.codec, link)
            latency = _mixture_quantiles(parts, cand.share, q)
            local = cand.share[:, : cand.partition + 1].sum(axis=1) if cand.partition >= 0 else np.zeros(len(latency))
            sent = 0.0 if cand.partition >= self.num_steps - 1 else payload_bytes(self.tables.shape_at(cand.partition),
                                                                                   cand.codec) + HEADER_BYTES  # fmt: skip
            for s in range(len(latency)):
                result.append(SplitOption(
                    partition=cand.partition, codec=cand.codec, criterion=self.criterion,
                    thresholds=tuple(None if math.isnan(t) else float(t) for t in cand.natural[s]),
                    accuracy=float(cand.accuracy[s]), latency_ms=float(latency[s]), device_share=float(local[s]),
                    bytes_per_request=float((1 - local[s]) * sent), exit_share=tuple(float(v) for v in cand.share[s]),
                ))  # fmt: skip
        return result

    def frontier(self, link: Link, quantile: float = 0.99) -> list[SplitOption]:
        """The options no other is both faster and at least as accurate as, cheapest first."""
        front: list[SplitOption] = []
        best = -math.inf
        for o in sorted(self.options(link, quantile), key=lambda o: (o.latency_ms, -o.accuracy, o.bytes_per_request)):
            if o.accuracy > best + 1e-12:
                front.append(o)
                best = o.accuracy
        return front

    def plan(self, link: Link, deadline_ms: float, quantile: float = 0.99) -> SplitPlan:
        """The most accurate option whose latency at ``quantile`` fits ``deadline_ms`` (ties: the faster); the
        fastest one, marked as not fitting, when none does."""
        deadline = check_deadline(deadline_ms)
        front = self.frontier(link, quantile)
        fitting = [o for o in front if o.latency_ms <= deadline]
        if fitting:
            return SplitPlan(fitting[-1], True, deadline, quantile, link, tuple(front), self.num_steps)
        fastest = front[0]
        return SplitPlan(fastest, False, deadline, quantile, link, tuple(front), self.num_steps,
                         note=f"no option fits {deadline:g} ms at p{100 * quantile:g}; the fastest takes "
                              f"{fastest.latency_ms:.3f} ms and will likely miss")  # fmt: skip


def _settings(scores: Scores) -> Tensor:
    """Signed threshold settings ``[S, K-1]``: every subset of enabled early exits (-inf: disabled) times shared
    threshold values."""
    early = scores.num_steps - 1
    values = shared_grid(scores, SHARED_VALUES)[:, 0]
    subsets: list[tuple[int, ...]]
    if 2**early <= MAX_SUBSETS:
        subsets = [s for r in range(early + 1) for s in itertools.combinations(range(early), r)]
    else:
        subsets = (
            [(), tuple(range(early))] + [(i,) for i in range(early)] + list(itertools.combinations(range(early), 2))
        )
    rows = []
    for subset in subsets:
        if not subset:
            rows.append(torch.full((1, early), -math.inf, dtype=torch.float64))
            continue
        block = torch.full((len(values), early), -math.inf, dtype=torch.float64)
        block[:, list(subset)] = values.view(-1, 1)
        rows.append(block)
    return torch.cat(rows)


def _mixture_quantiles(parts: list[np.ndarray], share: np.ndarray, q: float) -> np.ndarray:
    """For each row of ``share`` ``[S, K]``, the ``q`` quantile of the mixture of ``parts`` (sorted samples per exit)
    weighted by it, read on a grid of :data:`GRID_POINTS` latencies (never below the true quantile)."""
    low = min(float(p.min()) for p in parts)
    high = max(float(p.max()) for p in parts)
    grid = np.linspace(low, high, GRID_POINTS) if high > low else np.array([high])
    cdf = np.stack([np.searchsorted(p, grid, side="right") / p.size for p in parts])  # [K, G], parts sorted
    mixed = share @ cdf  # [S, G]
    index = np.argmax(mixed >= q - 1e-9, axis=1)
    return grid[index]
