"""The device profile: every step's measured latency on one device, as a versioned JSON file.

A profile belongs to a device and a model. It names the device (CPU model, cores, threads, GPU, power
mode), the software and the model's fingerprint, and keeps the raw latency samples (milliseconds), so
any quantile the sample count can resolve is available later and a policy's latency (a mixture of exit
paths) can be computed from the same samples.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from anytime.errors import AnytimeError
from anytime.profile.energy import BatchEnergy, EnergyMeter
from anytime.profile.stats import latency_summary, quantile_of
from anytime.utils.io import read_json, write_json

PROFILE_FORMAT = "anytime-profile-v1"


def device_slug(device: dict[str, Any]) -> str:
    """A file-name-safe name for a profiled device: ``cpu-<model>`` or ``cuda-<gpu name>``."""
    label = str(device.get("label") or device.get("type") or "device")
    slug = re.sub(r"[^a-z0-9]+", "-", label.lower()).strip("-")[:48].strip("-")
    kind = str(device.get("type") or "cpu")
    return slug if slug.startswith(kind) else f"{kind}-{slug}"


@dataclass(frozen=True)
class BatchLatency:
    """Latency samples (ms) at one batch size.

    ``steps[k]``: step k answered alone (``forward_until(x, k)``). ``stages[k]`` (incremental models only):
    going from step k-1's answer to step k's, measured in the same repetitions, so the cumulative sum of
    stages 0..k of one repetition is the time to reach exit k under early exit. ``energy``: joules per inference,
    where the profile measured energy (``anytime profile --energy``). ``suffixes[k][i]`` (``anytime profile
    --suffixes``): stage k+1+i when the pass starts after partition k from a stored activation, as a split
    server runs it (segments started cold run slower than inside one pass).

    ``answers[k]`` and ``answer_paths[k]`` are what an answer costs, measured as the anytime runtime pays it from
    the call to the answer (:func:`anytime.scheduler.pricing.price_answers`): step k chosen up front and run alone
    (``answers``), and, for incremental models, a request that goes through every exit head before k, the policy
    consulted at each, and answers at exit k (``answer_paths``). The scheduler and the runtime price options on
    these where a profile has them; a profile without them is priced on the model's own latencies.
    """

    batch_size: int
    steps: tuple[np.ndarray, ...]
    stages: tuple[np.ndarray, ...] | None
    memory: dict[str, Any] | None = None
    training: dict[str, float] | None = None
    energy: BatchEnergy | None = None
    suffixes: tuple[tuple[np.ndarray, ...], ...] | None = None
    answers: tuple[np.ndarray, ...] | None = None
    answer_paths: tuple[np.ndarray, ...] | None = None

    def suffix_paths(self, k: int) -> np.ndarray | None:
        """Per repetition, the time from a stored activation after partition ``k`` to each later exit
        ``[K-1-k, R]`` (cumulative), or None where the profile has no suffixes."""
        if self.suffixes is None:
            return None
        return np.cumsum(np.stack(self.suffixes[k]), axis=0)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able: summaries beside the raw samples."""

        def block(samples: tuple[np.ndarray, ...]) -> list[dict[str, Any]]:
            return [{**latency_summary(s / 1000), "samples_ms": [round(float(v), 5) for v in s]} for s in samples]

        return {"batch_size": self.batch_size, "steps": block(self.steps),
                "stages": None if self.stages is None else block(self.stages),
                "memory": self.memory, "training": self.training,
                "energy": None if self.energy is None else self.energy.to_dict(),
                **({} if self.suffixes is None else {"suffixes": [block(s) for s in self.suffixes]}),
                **({} if self.answers is None else {"answers": block(self.answers)}),
                **({} if self.answer_paths is None else {"answer_paths": block(self.answer_paths)})}  # fmt: skip


STEADY_WITHIN = 0.25  # a profile whose halves' tails part by more than this share was taken on a busy machine


@dataclass(frozen=True)
class Steadiness:
    """How far a profile's first half of repetitions lies from its second half: ``spread`` is the largest gap
    between the halves' tail quantiles as a share of the lower one, over every step and stage at every batch
    size (0 on a machine that stayed as it was), and ``where`` says which figure it was."""

    spread: float
    where: str


@dataclass(frozen=True)
class DeviceProfile:
    """Every step's latency on one device, with the model's costs and the device's description; ``energy``
    names the energy source where joules per inference were measured too (None: not measured); ``serving`` holds what
    a client on this machine waited beyond the server's own count, per request (ms; ``anytime profile --serve``)."""

    model_fingerprint: str | None
    model: str
    input_shape: tuple[int, ...]
    incremental: bool
    step_names: tuple[str, ...]
    step_flops: tuple[int, ...]
    step_params: tuple[int, ...]
    model_bytes: int
    latency: dict[int, BatchLatency]
    device: dict[str, Any]
    settings: dict[str, Any]
    created: str
    energy: EnergyMeter | None = None
    serving: np.ndarray | None = None

    @property
    def num_steps(self) -> int:
        """How many steps the profiled model has."""
        return len(self.step_names)

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """The batch sizes measured, ascending."""
        return tuple(sorted(self.latency))

    @property
    def samples_per_step(self) -> int:
        """The fewest samples behind any latency figure (what bounds the quantiles it can resolve)."""
        return min(
            s.size
            for b in self.latency.values()
            for s in b.steps + (b.stages or ()) + (b.answers or ()) + (b.answer_paths or ())
        )

    def at(self, batch_size: int) -> BatchLatency:
        """The latencies at one batch size; a clear error for one that was not measured."""
        try:
            return self.latency[batch_size]
        except (KeyError, TypeError):
            sizes = ", ".join(str(b) for b in self.batch_sizes)
            raise AnytimeError(
                f"the profile has no batch size {batch_size} (it measured {sizes}); "
                f"profile again with --batch-sizes including {batch_size}"
            ) from None

    def highest_quantile(self, cap: float = 0.99) -> float:
        """The highest quantile up to ``cap`` that the samples resolve (p99 from 100 samples on)."""
        n = self.samples_per_step
        return min(cap, 1 - 1 / n) if n > 1 else 0.5

    def check_quantile(self, q: float) -> float:
        """Refuse a quantile that is not a number in (0, 1) or that the samples cannot resolve."""
        if not isinstance(q, (int, float)) or not 0 < q < 1:
            raise AnytimeError(f"quantile {q} is not in (0, 1); use e.g. 0.5, 0.9 or 0.99")
        n = self.samples_per_step
        if q > 1 - 1 / n + 1e-12:
            need = math.ceil(1 / (1 - q) - 1e-9)
            raise AnytimeError(
                f"a {q} quantile needs at least {need} samples per step but the profile has {n}; "
                f"profile again with --repeats {need} or ask for a lower quantile"
            )
        return float(q)

    def step_quantile(self, k: int, q: float, batch_size: int = 1) -> float:
        """Step k alone at quantile q (ms)."""
        return quantile_of(self.at(batch_size).steps[k], q)

    def stage_quantile(self, k: int, q: float, batch_size: int = 1) -> float:
        """Going from step k-1 to step k at quantile q (ms); incremental models only."""
        stages = self.at(batch_size).stages
        if stages is None:
            raise AnytimeError("this profile has no stage latencies: the model is not incremental")
        return quantile_of(stages[k], q)

    def path_samples(self, k: int, batch_size: int = 1) -> np.ndarray:
        """Per repetition, the time to reach exit k through exits 0..k (cumulative stages)."""
        stages = self.at(batch_size).stages
        if stages is None:
            raise AnytimeError("this profile has no stage latencies: the model is not incremental")
        return np.sum(np.stack(stages[: k + 1]), axis=0)

    @property
    def priced(self) -> bool:
        """Whether every batch size has the runtime's answer prices (:attr:`BatchLatency.answers`)."""
        return all(b.answers is not None for b in self.latency.values())

    def answer_samples(self, k: int, batch_size: int = 1) -> np.ndarray:
        """What answering at step ``k`` chosen up front costs (ms per repetition): as the runtime paid it where the
        profile priced answers, else step k's own latency."""
        at = self.at(batch_size)
        return at.steps[k] if at.answers is None else at.answers[k]

    def answer_path_samples(self, k: int, batch_size: int = 1) -> np.ndarray:
        """What a request that goes through the exit heads and answers at exit ``k`` costs (ms per repetition): as
        the runtime paid it where the profile priced answers, else the stages 0..k summed; incremental models only."""
        at = self.at(batch_size)
        return self.path_samples(k, batch_size) if at.answer_paths is None else at.answer_paths[k]

    def steadiness(self, q: float = 0.99) -> Steadiness:
        """The halves of the repetitions compared at ``q``, or at the highest quantile that leaves ten samples
        above it in each half if lower: the repetitions interleave the steps, so a burst of other work on the
        machine shows up as one half's tail far from the other's."""
        worst, where = 0.0, "the halves agree"
        for b, at in sorted(self.latency.items()):
            for kind, series in (("step", at.steps), ("stage", at.stages or ())):
                for k, samples in enumerate(series):
                    half = len(samples) // 2
                    if half < 20:
                        continue
                    level = min(q, 1 - 10 / half)
                    first, second = quantile_of(samples[:half], level), quantile_of(samples[half:], level)
                    low = min(first, second)
                    spread = abs(first - second) / low if low > 0 else 0.0
                    if spread > worst:
                        worst = spread
                        where = (f"{kind} {self.step_names[k]} at batch {b}: p{100 * level:g} {first:.3f} ms in the "
                                 f"first half of the repetitions, {second:.3f} ms in the second")  # fmt: skip
        return Steadiness(worst, where)

    def require_energy(self, where: str = "the profile") -> EnergyMeter:
        """The energy meter, or a clear error for a profile measured without energy."""
        if self.energy is None or any(b.energy is None for b in self.latency.values()):
            raise AnytimeError(f"{where} has no energy figures; measure them with `anytime profile RUN --energy` "
                               "on a machine with an energy counter (RAPL, NVML or a Jetson's power rails)")  # fmt: skip
        return self.energy

    def step_energy_j(self, k: int, batch_size: int = 1) -> float:
        """Step k alone: mean joules per inference at a batch size."""
        self.require_energy()
        energy = self.at(batch_size).energy
        assert energy is not None
        return energy.steps[k].mean_j

    def path_energy_j(self, k: int, batch_size: int = 1) -> float:
        """Through exits 0..k in one pass (an early exit at k): mean joules per inference; incremental models only."""
        self.require_energy()
        energy = self.at(batch_size).energy
        assert energy is not None
        if energy.paths is None:
            raise AnytimeError("this profile has no exit-path energies: the model is not incremental")
        return energy.paths[k].mean_j

    def check_model(self, fingerprint: str | None, num_steps: int | None = None, *, where: str = "profile") -> None:
        """Refuse a profile measured on another model (other weights or another number of steps)."""
        if fingerprint is not None and self.model_fingerprint != fingerprint:
            raise AnytimeError(
                f"{where} was measured on another model (weights {self.model_fingerprint}, this one's are "
                f"{fingerprint}); profile this model with `anytime profile RUN`"
            )
        if num_steps is not None and num_steps != self.num_steps:
            raise AnytimeError(f"{where} has {self.num_steps} steps but the model has {num_steps}; profile it again")

    def to_dict(self) -> dict[str, Any]:
        """The versioned JSON document."""
        return {
            "format": PROFILE_FORMAT, "created": self.created, "model": self.model,
            "model_fingerprint": self.model_fingerprint, "input_shape": list(self.input_shape),
            "incremental": self.incremental, "model_bytes": self.model_bytes, "device": self.device,
            "settings": self.settings,
            "steps": [{"index": k, "name": n, "flops": f, "params": p}
                      for k, (n, f, p) in enumerate(zip(self.step_names, self.step_flops, self.step_params))],
            "batches": [self.latency[b].to_dict() for b in self.batch_sizes],
            "energy": None if self.energy is None else self.energy.to_dict(),
            **({} if self.serving is None else {"serving": {**latency_summary(self.serving / 1000),
                                                            "samples_ms": [round(float(v), 5) for v in self.serving]}}),
        }  # fmt: skip

    def save(self, path: str | Path) -> Path:
        """Write atomically (a temporary name, then a rename)."""
        return write_json(path, self.to_dict())

    @classmethod
    def from_dict(cls, doc: Any, *, where: str = "profile") -> DeviceProfile:
        """Rebuild from :meth:`to_dict`; one clear error for anything malformed (NaN or negative samples included)."""
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise AnytimeError(
                f"{where} is not an anytime profile (no '{PROFILE_FORMAT}' tag); make one with `anytime profile RUN`"
            )
        try:
            steps = doc["steps"]
            num_steps = len(steps)
            incremental = bool(doc["incremental"])
            latency: dict[int, BatchLatency] = {}
            for entry in doc["batches"]:
                b = entry["batch_size"]
                if not isinstance(b, int) or isinstance(b, bool) or b < 1 or b in latency:
                    raise ValueError("batch sizes must be distinct positive integers")
                step_samples = tuple(_samples(s["samples_ms"], where) for s in entry["steps"])
                stages = entry.get("stages")
                stage_samples = None if stages is None else tuple(_samples(s["samples_ms"], where) for s in stages)
                if len(step_samples) != num_steps or (stage_samples is not None and len(stage_samples) != num_steps):
                    raise ValueError("steps do not match")
                if incremental and (stage_samples is None or len({s.size for s in stage_samples}) != 1):
                    raise ValueError("stages missing or ragged")
                energy = entry.get("energy")
                suffixes = entry.get("suffixes")
                suffix_samples = None if suffixes is None else tuple(
                    tuple(_samples(s["samples_ms"], where) for s in part) for part in suffixes)  # fmt: skip
                if suffix_samples is not None and (not incremental or [len(p) for p in suffix_samples]
                                                   != list(range(num_steps - 1, 0, -1))):  # fmt: skip
                    raise ValueError("suffixes do not match the steps")
                answers = _optional_block(entry.get("answers"), num_steps, where)
                answer_paths = _optional_block(entry.get("answer_paths"), num_steps, where)
                if answer_paths is not None and (not incremental or answers is None):
                    raise ValueError("answer paths without answers, or on a model that is not incremental")
                latency[b] = BatchLatency(b, step_samples, stage_samples, entry.get("memory"), entry.get("training"),
                                          None if energy is None else BatchEnergy.from_dict(energy, num_steps, where),
                                          suffix_samples, answers, answer_paths)  # fmt: skip
            if not latency or num_steps < 1:
                raise ValueError("empty")
            meter = None if doc.get("energy") is None else EnergyMeter.from_dict(doc["energy"])
            if (meter is None) != all(b.energy is None for b in latency.values()):
                raise ValueError("energy figures without their meter, or a meter without figures")
            return cls(
                model_fingerprint=doc.get("model_fingerprint"), model=str(doc["model"]),
                input_shape=tuple(int(v) for v in doc["input_shape"]), incremental=incremental,
                step_names=tuple(str(s["name"]) for s in steps), step_flops=tuple(int(s["flops"]) for s in steps),
                step_params=tuple(int(s["params"]) for s in steps), model_bytes=int(doc["model_bytes"]),
                latency=latency, device=dict(doc["device"]), settings=dict(doc.get("settings") or {}),
                created=str(doc.get("created", "")), energy=meter,
                serving=None if doc.get("serving") is None else _samples(doc["serving"]["samples_ms"], where),
            )  # fmt: skip
        except AnytimeError:
            raise
        except (KeyError, TypeError, ValueError):
            raise AnytimeError(
                f"{where} is a malformed profile (missing or inconsistent fields); profile again"
            ) from None

    @classmethod
    def load(cls, path: str | Path, *, fingerprint: str | None = None, num_steps: int | None = None) -> DeviceProfile:
        """Read a profile file, refused if it is malformed or (given a fingerprint) from another model."""
        doc = read_json(path, what="profile", make="measure one with `anytime profile RUN`", redo="profile again")
        profile = cls.from_dict(doc, where=str(path))
        profile.check_model(fingerprint, num_steps, where=str(path))
        return profile


def _optional_block(entries: Any, num_steps: int, where: str) -> tuple[np.ndarray, ...] | None:
    """One sample array per step from a list of ``{"samples_ms": [...]}`` entries, or None where there is none."""
    if entries is None:
        return None
    block = tuple(_samples(e["samples_ms"], where) for e in entries)
    if len(block) != num_steps:
        raise ValueError("steps do not match")
    return block


def _samples(values: Any, where: str) -> np.ndarray:
    array = np.asarray(values, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError("no samples")
    if not np.isfinite(array).all() or (array < 0).any():
        raise AnytimeError(f"{where} holds a NaN, infinite or negative latency; profile again")
    return array
