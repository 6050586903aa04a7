"""Full-batch L-BFGS for the small convex fits the framework makes beside its networks (baselines, exit gates)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor


def minimise(parameters: Sequence[Tensor], loss: Callable[[], Tensor], *, steps: int, tolerance: float) -> None:
    """Minimise ``loss()`` over ``parameters`` (leaf tensors that require grad, updated in place) by L-BFGS with a
    strong-Wolfe line search, at most ``steps`` iterations, stopping once the gradient's largest entry is below
    ``tolerance``. Deterministic for deterministic inputs."""
    import torch

    optimiser = torch.optim.LBFGS(list(parameters), lr=1, max_iter=steps, history_size=10, tolerance_grad=tolerance,
                                  line_search_fn="strong_wolfe")  # fmt: skip

    def closure() -> Tensor:
        optimiser.zero_grad()
        value = loss()
        value.backward()
        return value

    with torch.enable_grad():
        optimiser.step(closure)
