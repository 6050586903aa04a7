"""The two processes of split computing as commands: ``anytime serve RUN --role server`` (:func:`serve_split`) and
``anytime split-run`` (:func:`run_split_session`), which answers a split's images one at a time over a shaped
link and reports what it measured beside what was planned."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from anytime.errors import AnytimeError
from anytime.profile.slowed import slowed_model
from anytime.profile.stats import quantile_of
from anytime.scheduler.deadline import check_deadline
from anytime.split.device import SplitAnswer, SplitDevice
from anytime.split.link import LinkError, LinkShaper, SplitClient
from anytime.split.plan import Link, PlanSettings, SplitPlan
from anytime.utils.collector import collect_due, serving_gc

if TYPE_CHECKING:
    from anytime.train.folder import RunFolder

WARMUP = 5  # answers before the timed ones, on images not counted
SESSION_FORMAT = "anytime-split-session-v1"  # the tag of a session's --out file, which a later session may replace
LINK_SAMPLES = 100  # exchanges that measure the link before the first plan (its overhead's p99 needs about 100)


def parse_bandwidth_schedule(text: str | None, default_mbps: float, requests: int) -> list[tuple[float, int]]:
    """``100:50,1:50`` -> [(100, 50), (1, 50)]: the link's bandwidth for each phase of a session; a phase without
    a count lasts to the end. None: ``default_mbps`` for every request."""
    if text is None:
        return [(float(default_mbps), requests)]
    phases: list[tuple[float, int]] = []
    items = [t.strip() for t in text.split(",") if t.strip()]
    for i, item in enumerate(items):
        rate, _, count = item.partition(":")
        try:
            mbps = float(rate)
            n = int(count) if count else requests - sum(c for _, c in phases)
        except ValueError:
            raise AnytimeError(f"--shape-bandwidth item {item!r} is not MBPS or MBPS:N (e.g. 100:50,1:50)") from None
        if not (0 < mbps < math.inf) or n < 1 or (not count and i != len(items) - 1):
            raise AnytimeError(f"--shape-bandwidth item {item!r}: a positive bandwidth and count; only the last may "
                               "omit its count")  # fmt: skip
        phases.append((mbps, n))
    if not phases:
        raise AnytimeError("--shape-bandwidth is empty; give e.g. 100:50,1:50")
    return phases


def serve_split(run_dir: RunFolder | str | Path, *, host: str = "127.0.0.1", port: int = 9000,
                threads: int | str | None = None, device: str = "auto", max_payload_kb: int = 1024,
                on_ready: Callable[[str], None] | None = None) -> None:  # fmt: skip
    """Serve the run's later segments to split-computing devices until interrupted."""
    from anytime.split.server import SplitServer, SplitService
    from anytime.train.folder import open_run
    from anytime.train.runs import require_images
    from anytime.utils.machine import resolve_device
    from anytime.utils.threads import set_threads

    set_threads(threads)
    run = open_run(run_dir).load(resolve_device(device))
    require_images(run, "split computing")
    size = run.dataset.get("image_size") or [32, 32]
    shape = (int(run.dataset["in_channels"]), int(size[0]), int(size[1]))
    service = SplitService(run.model, shape, fingerprint=run.fingerprint)
    server = SplitServer(service, host, port, max_payload=max_payload_kb * 1024)
    if on_ready is not None:
        on_ready("{}:{}".format(*server.address))
    try:
        with serving_gc():
            server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()


@dataclass(frozen=True)
class Phase:
    """A stretch of a session at one shaped bandwidth: its requests' figures and the plans that served them."""

    bandwidth_mbps: float
    requests: int
    accuracy: float
    p50_ms: float
    p99_ms: float
    miss_rate: float
    plans: tuple[str, ...]
    planned_ms: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-able."""
        return asdict(self)


@dataclass(frozen=True)
class SessionResult:
    """Every answer of a session, its labels, the plans in force (answer index, plan) and the deadline."""

    answers: tuple[SplitAnswer, ...]
    labels: tuple[int, ...]
    plans: tuple[tuple[int, SplitPlan], ...]
    deadline_ms: float
    schedule: tuple[tuple[float, int], ...]
    start_note: str | None = None

    def _plan_at(self, i: int) -> SplitPlan:
        current = self.plans[0][1]
        for start, plan in self.plans:
            if start <= i:
                current = plan
        return current

    def _figures(self, rows: range) -> dict[str, Any]:
        totals = np.array([self.answers[i].total_ms for i in rows])
        right = [self.answers[i].prediction == self.labels[i] for i in rows]
        return {"accuracy": float(np.mean(right)), "p50_ms": quantile_of(totals, 0.5), "p99_ms": quantile_of(totals, 0.99),
                "miss_rate": float(np.mean(totals > self.deadline_ms))}  # fmt: skip

    def phases(self) -> list[Phase]:
        """Per bandwidth phase: accuracy, p50/p99, miss rate, the plans used and the latency the last one planned."""
        out, start = [], 0
        for mbps, count in self.schedule:
            rows = range(start, min(start + count, len(self.answers)))
            start += count
            if not len(rows):
                break
            names = tuple(dict.fromkeys(self._plan_at(i).option.name(self._plan_at(i).num_steps) for i in rows))
            out.append(Phase(mbps, len(rows), **self._figures(rows), plans=names,
                             planned_ms=self._plan_at(rows[-1]).option.latency_ms))  # fmt: skip
        return out

    def summary(self) -> dict[str, Any]:
        """The session's figures (JSON-able): accuracy, p50/p99, misses, where answers came from, bytes, the plan."""
        n = len(self.answers)
        where = [a.where for a in self.answers]
        first = self.plans[0][1]
        return {"requests": n, **self._figures(range(n)), "deadline_ms": self.deadline_ms,
                "planned_ms": first.option.latency_ms, "plan": first.to_dict() | {"frontier": None},
                "device_share": where.count("device") / n, "server_share": where.count("server") / n,
                "fallback_share": where.count("fallback") / n,
                "mean_sent_bytes": float(np.mean([a.sent_bytes for a in self.answers])),
                "replans": [{"at": i, "option": p.option.name(p.num_steps), "bandwidth_mbps": p.link.bandwidth_mbps,
                             "rtt_ms": p.link.rtt_ms, "link_overhead_ms": p.link.overhead_ms,
                             "planned_ms": p.option.latency_ms} for i, p in self.plans],
                "phases": [p.to_dict() for p in self.phases()], "start_note": self.start_note}  # fmt: skip

    def notes(self) -> list[str]:
        """Lines for the terminal: how the session started, each re-plan, each distinct fallback reason."""
        first = self.plans[0][1]
        lines = [] if self.start_note is None else [self.start_note]
        lines.append(f"planned for a link of {first.link.bandwidth_mbps:.3g} Mbit/s, {first.link.rtt_ms:.3g} ms round "
                     f"trip, {first.link.overhead_ms:.3g} ms overhead per exchange: "
                     f"{first.option.name(first.num_steps)}")  # fmt: skip
        for i, plan in self.plans[1:]:
            lines.append(f"after {i} answers: link seen at {plan.link.bandwidth_mbps:.3g} Mbit/s, "
                         f"{plan.link.rtt_ms:.3g} ms, {plan.link.overhead_ms:.3g} ms overhead: now "
                         f"{plan.option.name(plan.num_steps)}")  # fmt: skip
        seen: set[str] = set()
        for a in self.answers:
            if a.note and a.note not in seen:
                seen.add(a.note)
                lines.append(a.note)
        for p in self.phases():
            lines.append(f"{p.bandwidth_mbps:g} Mbit/s, {p.requests} requests: accuracy {100 * p.accuracy:.2f}%, "
                         f"p99 {p.p99_ms:.3f} ms (planned {p.planned_ms:.3f}), misses {100 * p.miss_rate:.2f}%, "
                         f"{' -> '.join(p.plans)}")  # fmt: skip
        return lines

    def to_dict(self) -> dict[str, Any]:
        """The summary and every answer with its label."""
        return {"format": SESSION_FORMAT, "summary": self.summary(),
                "answers": [a.to_dict() | {"label": y} for a, y in zip(self.answers, self.labels)]}  # fmt: skip


@dataclass(frozen=True)
class SessionSettings:
    """How a split-computing session runs (:func:`run_split_session`).

    The device talks to the ``anytime serve --role server`` at ``host``:``port`` and answers every request within
    ``deadline_ms`` (ms; a slower answer is a miss). It answers ``requests`` images of the ``split`` (val or test),
    the link paced per ``schedule`` ((Mbit/s, requests) phases as :func:`parse_bandwidth_schedule` reads them; None:
    the planned link's bandwidth for every request) with ``delay_ms`` of round trip added (None: the planned link's
    ``rtt_ms``). ``slowdown`` > 1 emulates a board that many times slower (its profile must be measured with the same
    factor); ``adapt`` re-plans as the bandwidth the device measures moves (False: the first plan is kept). A server
    that has not answered within ``timeout_ms`` (ms) is given up on and the device answers itself. ``threads`` are
    the device's torch CPU threads (a number, ``auto``, or None: as they are); ``link_samples`` exchanges measure the
    link before the first plan (0: plan with the link as given, overhead included)."""

    host: str
    port: int
    deadline_ms: float
    split: str = "test"
    requests: int = 200
    schedule: tuple[tuple[float, int], ...] | None = None
    delay_ms: float | None = None
    slowdown: float = 1.0
    adapt: bool = True
    timeout_ms: float = 2000.0
    threads: int | str | None = 1
    link_samples: int = LINK_SAMPLES

    def __post_init__(self) -> None:
        object.__setattr__(self, "deadline_ms", check_deadline(self.deadline_ms))  # kept as the float it checks to
        link_samples = self.link_samples
        if isinstance(link_samples, bool) or not isinstance(link_samples, int) or link_samples < 0:
            raise AnytimeError(f"--link-samples is a number of exchanges >= 0 (got {link_samples!r})")
        if not (math.isfinite(self.timeout_ms) and self.timeout_ms > 0):
            raise AnytimeError(f"--timeout-ms must be a positive number (got {self.timeout_ms})")


def run_split_session(
    run_dir: str | Path, session: SessionSettings, plan: PlanSettings | None = None, *, device_profile: str | Path,
    server_profile: str | Path, link: Link, out: str | Path | None = None,
) -> SessionResult:  # fmt: skip
    """Answer ``session.requests`` images of its split as the device: ping the server, measure the link with
    ``session.link_samples`` exchanges (none: plan with ``link`` as given, overhead included), plan as ``plan`` says
    (default :class:`PlanSettings`), then answer one image at a time (after :data:`WARMUP` untimed ones), the link
    shaped per ``session.schedule``; the result holds every answer."""
    from anytime.split.runs import planner_for_run
    from anytime.utils.io import write_json
    from anytime.utils.outputs import check_output_file
    from anytime.utils.threads import set_threads

    plan = plan or PlanSettings()
    target = None if out is None else check_output_file(out, what="split-run result", format_tag=SESSION_FORMAT,
                                                        example="split.json")  # fmt: skip
    phases = session.schedule or ((link.bandwidth_mbps, session.requests),)
    _check_slowdown(device_profile, session.slowdown)
    set_threads(session.threads)
    planner = planner_for_run(run_dir, device_profile, server_profile, plan)
    model, images, labels = _session_images(run_dir, session)
    shaper = LinkShaper(phases[0][0], link.rtt_ms if session.delay_ms is None else session.delay_ms)
    client = SplitClient(session.host, session.port, timeout_s=session.timeout_ms / 1000, shaper=shaper)
    device = SplitDevice(model, planner, client, deadline_ms=session.deadline_ms, quantile=plan.quantile, link=link,
                         adapt=session.adapt)  # fmt: skip
    start_note = _measure_link(device, images, session.link_samples)
    try:
        answers, plans = _answer_all(device, shaper, images, phases, session.requests)
    finally:
        client.close()
    result = SessionResult(tuple(answers), tuple(labels), tuple(plans), session.deadline_ms, tuple(phases), start_note)
    if target is not None:
        write_json(target, result.to_dict())
    return result


def _check_slowdown(device_profile: str | Path, slowdown: float) -> None:
    """Refuse a device profile measured at another emulated slowdown than the one this device runs at."""
    from anytime.profile.store import DeviceProfile

    measured_at = float(DeviceProfile.load(device_profile).settings.get("emulated_slowdown", 1.0))
    if abs(measured_at - slowdown) > 1e-9:
        raise AnytimeError(f"{device_profile} was measured with --emulate-slowdown {measured_at:g} but this device runs at "
                           f"{slowdown:g}; profile it again with --emulate-slowdown {slowdown:g}")  # fmt: skip


def _session_images(run_dir: str | Path, session: SessionSettings) -> tuple[Any, Any, list[int]]:
    """The run's model (slowed as the session says), the warm-up and timed images of its split (normalized) and
    the timed ones' labels."""
    import torch

    from anytime.data.augment import normalize
    from anytime.train.runs import load_run
    from anytime.train.splits import run_splits

    run = load_run(run_dir, "cpu")
    model = slowed_model(run.model, session.slowdown)
    model.eval()
    splits = run_splits(run)
    data = getattr(splits, session.split)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0))  # splits are stored class by class
    if session.requests + WARMUP > len(order):
        raise AnytimeError(
            f"the {session.split} split has {len(order)} images; ask for at most {len(order) - WARMUP} --requests"
        )
    chosen = order[: session.requests + WARMUP]
    images = normalize(data.images[chosen], splits.info.mean, splits.info.std)
    labels = [int(v) for v in data.labels[chosen][WARMUP:]]
    return model, images, labels


def _measure_link(device: SplitDevice, images: Any, link_samples: int) -> str | None:
    """Ping the server and measure the link before the first plan; a server that does not answer is noted (the
    device answers on its own until it is back)."""
    try:
        device.ping()
        if link_samples:
            device.measure_link(images[:1], link_samples)
        device.replans.clear()
    except LinkError as exc:
        return f"{exc}: answering on the device until it is back"
    return None


def _answer_all(
    device: SplitDevice, shaper: LinkShaper, images: Any, phases: Sequence[tuple[float, int]], requests: int
) -> tuple[list[SplitAnswer], list[tuple[int, SplitPlan]]]:
    """The warm-up answers, then every timed one with the link paced per phase; the answers and the plans in force
    (answer index, plan)."""
    for i in range(WARMUP):
        device.answer(images[i : i + 1])
    device.replans.clear()
    plans: list[tuple[int, SplitPlan]] = [(0, device.plan)]
    device.answered = 0
    answers: list[SplitAnswer] = []
    boundary, phase = phases[0][1], 0
    with serving_gc():
        for i in range(requests):
            if i == boundary and phase + 1 < len(phases):
                phase += 1
                shaper.set_bandwidth(phases[phase][0])
                boundary += phases[phase][1]
            x = images[WARMUP + i : WARMUP + i + 1]
            answers.append(device.answer(x))
            device.maybe_probe()
            collect_due()
    plans += [(i, p) for i, p in device.replans]
    return answers, plans
