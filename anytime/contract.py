"""The step contract, as protocols: what every family of anytime steps (exits, slices, block-drop ladders,
ensembles, converted models) offers, and what the profiler, the trainer, the cache and the runtime may rely on.

Checked structurally, so a user's own family needs no base class; a plain ``nn.Module`` is one step.
``tests/test_contract.py`` runs every family in the package through the same checks. Check a model with
:func:`is_anytime` and :func:`is_segmented` rather than ``isinstance`` on the protocols: since Python 3.12 that
``isinstance`` looks attributes up statically, and misses what an ``nn.Module`` keeps as a submodule (a multi-exit
network's ``heads`` list).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from torch import Tensor, nn


@runtime_checkable
class AnytimeModel(Protocol):
    """A model that answers at ``num_steps`` points of rising cost.

    ``forward_until(x, k)``: step k's logits ``[N, C]``, computing no more than step k needs. ``forward_all(x)``:
    every step's logits ``[K, N, C]``, cheapest first. ``steps(x)``: the same answers one at a time, each computed
    only when the iterator is advanced. A model whose step k+1 continues from step k's work (early exits, an
    ensemble's members) is *incremental*; one whose steps are separate forwards (slices, a ladder) sets
    ``incremental = False``, and the runtime then picks one step per request up front.
    """

    @property
    def num_steps(self) -> int: ...

    def forward_until(self, x: Tensor, k: int) -> Tensor: ...

    def forward_all(self, x: Tensor) -> Tensor: ...

    def steps(self, x: Tensor) -> Iterator[Tensor]: ...


@runtime_checkable
class SegmentedModel(AnytimeModel, Protocol):
    """An incremental model built of ``segments`` (what runs between two exits) and ``heads`` (one per early exit):
    what real early exit (:meth:`anytime.calibrate.ExitPolicy.run`) and per-part quantization work on."""

    @property
    def segments(self) -> Sequence[nn.Module]: ...

    @property
    def heads(self) -> Sequence[nn.Module]: ...


def _members(protocol: type) -> tuple[str, ...]:
    """The names a protocol declares (its own and its bases'), read from the class bodies above."""
    return tuple(sorted({name for cls in protocol.__mro__ if cls.__module__ == __name__
                         for name in vars(cls) if not name.startswith("_")}))  # fmt: skip


_ANYTIME_MEMBERS = _members(AnytimeModel)
_SEGMENTED_MEMBERS = _members(SegmentedModel)


def is_anytime(model: Any) -> bool:
    """Whether ``model`` offers the step contract (:class:`AnytimeModel`), its members looked up as Python does."""
    return all(hasattr(model, name) for name in _ANYTIME_MEMBERS)


def is_segmented(model: Any) -> bool:
    """Whether ``model`` is built of segments and exit heads (:class:`SegmentedModel`)."""
    return all(hasattr(model, name) for name in _SEGMENTED_MEMBERS)


def step_count(model: Any) -> int:
    """Steps of a model under the contract; 1 for a plain classifier."""
    return int(model.num_steps) if is_anytime(model) else 1


def is_incremental(model: Any) -> bool:
    """Whether step k+1 reuses step k's work (a contract model, unless it says ``incremental = False``)."""
    return is_anytime(model) and bool(getattr(model, "incremental", True))


def run_step(model: Any, x: Tensor, k: int) -> Tensor:
    """Step ``k`` of ``model`` alone (a plain classifier's only step is its forward)."""
    return model.forward_until(x, k) if is_anytime(model) else model(x)
