"""The serving core behind ``anytime serve``: requests queue, one worker thread answers them in batches with the
anytime runtime, and the time a request waited counts against its deadline.

The HTTP layer (:mod:`anytime.serve.http`) only parses, hands a :class:`Request` to :meth:`Service.submit` and
waits for its :class:`Answer`. Everything that decides (what is left of a deadline, who has already missed,
how large a batch is) lives here and reads one injectable clock, so tests drive it without sleeping.
"""

from __future__ import annotations

import math
import queue
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from anytime.errors import AnytimeError, BadRequest
from anytime.serve.cooperate import DEFAULT_EVERY_MS, YieldPoints
from anytime.serve.metrics import Metrics
from anytime.utils.collector import collect_due, serving_gc
from anytime.utils.timer import Clock, monotonic

if TYPE_CHECKING:
    import torch

    from anytime.scheduler import AnytimeRunner

#: Reasons an answer gives for where it stopped: the runtime's own, plus ``expired`` (the deadline had passed
#: while the request queued, so no step was run for it unless the cheapest answer was asked for).
REASONS = ("confident", "deadline", "energy", "last", "chosen", "expired")


@dataclass(frozen=True)
class Request:
    """One input (``[C, H, W]`` float32, already normalised; or a sentence's token ids ``[T]``) with its deadline
    (and optionally an energy budget per inference), stamped when it arrived."""

    image: torch.Tensor
    deadline_ms: float
    arrived: float
    cheapest: bool = False
    energy_mj: float | None = None


@dataclass(frozen=True)
class Answer:
    """What the server answers: the class (None when the deadline passed in the queue and no answer was
    asked for), the step that answered and why it stopped, the time queued and computing, and whether the
    whole (from the request's arrival at the server to its answer) fit in the deadline. ``option``,
    ``promised_ms`` and ``fits`` are the runtime's promise: the option it ran, its price and whether that fitted
    the time left (False: nothing fitted, or the request expired in the queue)."""

    label: int | None
    class_name: str | None
    step: int | None
    step_name: str | None
    reason: str
    queued_ms: float
    compute_ms: float
    total_ms: float
    deadline_ms: float
    met: bool
    batch_size: int
    option: str | None = None
    promised_ms: float | None = None
    fits: bool = False

    def to_dict(self) -> dict[str, Any]:
        """The JSON body of ``POST /predict``."""
        return {"class": self.label, "class_name": self.class_name, "step": self.step, "step_name": self.step_name,
                "reason": self.reason, "queued_ms": round(self.queued_ms, 3), "compute_ms": round(self.compute_ms, 3),
                "total_ms": round(self.total_ms, 3), "deadline_ms": self.deadline_ms, "met": self.met,
                "batch_size": self.batch_size, "option": self.option,
                "promised_ms": None if self.promised_ms is None else round(self.promised_ms, 3), "fits": self.fits}  # fmt: skip


def _positive(text: str, what: str, unit: str, units: str) -> float:
    """A finite positive number from a request, or a :class:`BadRequest` naming ``what`` it was meant to be."""
    try:
        value = float(text)
    except ValueError:
        raise BadRequest(f"{what} '{str(text)[:40]}' is not a number of {units}") from None
    if not math.isfinite(value) or value <= 0:
        raise BadRequest(f"{what} {text} {unit} must be a finite positive number of {units}")
    return value


def parse_deadline(text: str | None) -> float:
    """A request's deadline in milliseconds; a :class:`BadRequest` for a missing, malformed, NaN or non-positive one."""
    if text is None or not str(text).strip():
        raise BadRequest("no deadline: give deadline_ms (a form field or query parameter) or an X-Deadline-Ms header")
    return _positive(text, "deadline", "ms", "milliseconds")


def parse_energy_budget(text: str | None) -> float | None:
    """A request's energy budget in millijoules per inference (None when not given); a :class:`BadRequest` for a
    malformed, NaN or non-positive one."""
    if text is None or not str(text).strip():
        return None
    return _positive(text, "energy budget", "mJ", "millijoules")


class Service:
    """The runtime of one run behind a queue: :meth:`submit` from any thread, one worker answers.

    ``max_batch`` requests at most (default: the largest profiled batch size, up to 8) are answered together (those already queued when the worker is free; it
    never waits for more), under the tightest deadline left among them. ``clock`` is in seconds (monotonic). While
    answering, the worker lets other threads run at the next block boundary whenever ``yield_ms`` have passed since it
    last did (:class:`~anytime.serve.cooperate.YieldPoints`; 0 or None: never).
    """

    def __init__(
        self, runner: AnytimeRunner, *, step_names: Sequence[str], class_names: Sequence[str] | None = None,
        max_batch: int | None = None, max_queue: int = 1024, clock: Clock = monotonic,
        yield_ms: float | None = DEFAULT_EVERY_MS,
    ) -> None:  # fmt: skip
        largest = max(runner.profile.batch_sizes)
        max_batch = min(8, largest) if max_batch is None else max_batch
        if max_batch < 1:
            raise AnytimeError(f"--max-batch must be at least 1 (got {max_batch})")
        if max_batch > largest:
            raise AnytimeError(f"--max-batch {max_batch} is larger than any batch size the profile measured ({largest}); "
                               f"profile with --batch-sizes up to {max_batch} or serve with --max-batch {largest}")  # fmt: skip
        self.runner = runner
        self.step_names = tuple(step_names)
        self.class_names = tuple(class_names) if class_names else None
        self.max_batch = max_batch
        self.clock = clock
        if yield_ms is not None and not (math.isfinite(yield_ms) and yield_ms >= 0):
            raise AnytimeError(f"--yield-ms must be 0 (never) or more (got {yield_ms})")
        self.yield_ms = yield_ms
        self.metrics = Metrics(self.step_names)
        self._queue: queue.Queue[tuple[Request, Future[Answer]] | None] = queue.Queue(maxsize=max_queue)
        self._worker: threading.Thread | None = None

    def warm_up(self, example: torch.Tensor, repeats: int = 3) -> None:
        """Run every step on ``example`` (``[C, H, W]``, or token ids ``[T]``) at every batch size served, so that the first requests
        do not pay for lazy initialisation (allocators, kernels picked on first call)."""
        import torch

        from anytime.contract import run_step

        with torch.inference_mode():
            for batch in sorted({1, self.max_batch}):
                x = example.expand(batch, *example.shape).contiguous()
                for _ in range(repeats):
                    for k in range(len(self.step_names)):
                        run_step(self.runner.model, x, k)

    def start(self) -> None:
        """Start the worker thread (idempotent)."""
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="anytime-serve", daemon=True)
            self._worker.start()

    def stop(self) -> None:
        """Let the worker answer what is queued, then end it."""
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join()
            self._worker = None

    @property
    def queue_depth(self) -> int:
        """Requests waiting for the worker."""
        return self._queue.qsize()

    def submit(self, request: Request) -> Future[Answer]:
        """Queue ``request``; its answer arrives on the returned future. A full queue is refused (503)."""
        future: Future[Answer] = Future()
        try:
            self._queue.put_nowait((request, future))
        except queue.Full:
            raise BadRequest("the server's queue is full; retry later or lower the request rate", status=503) from None
        return future

    def answer_now(self, requests: Sequence[Request]) -> list[Answer]:
        """Answer ``requests`` as one batch, now, on the calling thread (the worker's step; tests call it)."""
        gone = [self._left_ms(r) <= 0 for r in requests]  # read once: a request is live or expired, never both
        live = [r for r, g in zip(requests, gone) if not g]
        expired = [r for r, g in zip(requests, gone) if g]
        answers: dict[int, Answer] = {}
        if expired:
            for r, a in zip(expired, self._expired(expired)):
                answers[id(r)] = a
        if live:
            for r, a in zip(live, self._run(live)):
                answers[id(r)] = a
        out = [answers[id(r)] for r in requests]
        for a in out:
            self.metrics.record(a)
        self.metrics.set_drift(self.runner.drift.level())
        return out

    def _batch(self, requests: Sequence[Request]) -> torch.Tensor:
        import torch

        device = next((p.device for p in self.runner.model.parameters()), torch.device("cpu"))
        inputs = [r.image for r in requests]
        if inputs[0].dim() == 1:  # sentences' token ids, padded to the longest (the encoders ignore padding)
            from torch.nn.utils.rnn import pad_sequence

            from anytime.data.text import PAD_ID

            return pad_sequence(inputs, batch_first=True, padding_value=PAD_ID).to(device)
        return torch.stack(inputs).to(device)

    def _left_ms(self, request: Request) -> float:
        return request.deadline_ms - 1000.0 * (self.clock() - request.arrived)

    def _run(self, requests: Sequence[Request]) -> list[Answer]:
        started = self.clock()
        budget = min(self._left_ms(r) for r in requests)
        energy = min((r.energy_mj for r in requests if r.energy_mj is not None), default=None)
        prediction = self.runner.predict(self._batch(requests), max(budget, 1e-6), energy)
        done = self.clock()
        exits = prediction.exits.tolist()
        labels = prediction.predictions.tolist()
        answers = []
        for r, label, k in zip(requests, labels, exits):
            reason = "confident" if prediction.reason != "chosen" and k < prediction.step else prediction.reason
            answer = self._answer(r, int(label), int(k), reason, started, done, len(requests))
            answers.append(replace(answer, option=prediction.option, promised_ms=prediction.promised_ms,
                                   fits=prediction.fits))  # fmt: skip
        return answers

    def _expired(self, requests: Sequence[Request]) -> list[Answer]:
        import torch

        from anytime.contract import run_step

        wanted = [r for r in requests if r.cheapest]
        started = self.clock()
        labels: dict[int, int] = {}
        if wanted:
            with torch.inference_mode():
                logits = run_step(self.runner.model, self._batch(wanted), 0)
            labels = {id(r): int(c) for r, c in zip(wanted, logits.argmax(dim=1).tolist())}
        done = self.clock()
        return [self._answer(r, labels.get(id(r)), 0 if id(r) in labels else None, "expired", started,
                             done if id(r) in labels else started, len(requests)) for r in requests]  # fmt: skip

    def _answer(self, request: Request, label: int | None, step: int | None, reason: str, started: float,
                done: float, batch: int) -> Answer:  # fmt: skip
        queued = 1000.0 * (started - request.arrived)
        total = 1000.0 * (done - request.arrived)
        name = None
        if label is not None and self.class_names is not None and 0 <= label < len(self.class_names):
            name = self.class_names[label]
        return Answer(
            label=label, class_name=name, step=step, step_name=None if step is None else self.step_names[step],
            reason=reason, queued_ms=queued, compute_ms=1000.0 * (done - started), total_ms=total,
            deadline_ms=request.deadline_ms, met=label is not None and total <= request.deadline_ms, batch_size=batch,
        )  # fmt: skip

    def _work(self) -> None:
        # The collector is kept out of the answers and runs between them, as the profile's prices were timed.
        with serving_gc(), YieldPoints(self.runner.model, self.yield_ms):
            self._serve_queue()

    def _serve_queue(self) -> None:
        while True:
            collect_due()
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            stop = False
            while len(batch) < self.max_batch:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stop = True
                    break
                batch.append(more)
            try:
                answers = self.answer_now([r for r, _ in batch])
            except Exception as exc:  # noqa: BLE001 - a failed batch fails its requests, never the server
                for _, future in batch:
                    future.set_exception(exc)
            else:
                for (_, future), answer in zip(batch, answers):
                    future.set_result(answer)
            if stop:
                return
