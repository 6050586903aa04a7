"""What the families whose steps are separate forwards (slices, block-drop ladders) share."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from anytime.errors import AnytimeError


class SeparateSteps(nn.Module):
    """A model under the step contract whose step k is a forward of its own (step k+1 does not reuse step k's
    work): ``forward_until(x, k)``, ``steps(x)``, ``forward_all(x)`` (``[K, B, C]``, cheapest first) and
    ``forward`` (the same). Subclasses give ``num_steps`` and ``_run(x, k)``; the runtime chooses one step
    per request for them."""

    incremental = False
    family = "model"

    @property
    def num_steps(self) -> int:
        """The number of steps."""
        raise NotImplementedError

    def _run(self, x: Tensor, k: int) -> Tensor:
        raise NotImplementedError

    def forward_until(self, x: Tensor, k: int) -> Tensor:
        """Logits ``[B, C]`` of step ``k`` alone."""
        if not isinstance(k, int) or not -self.num_steps <= k < self.num_steps:
            raise AnytimeError(f"step {k} does not exist; this {self.family} has steps 0..{self.num_steps - 1}")
        return self._run(x, k % self.num_steps)

    def steps(self, x: Tensor) -> Iterator[Tensor]:
        """Each step's logits in turn, each a separate forward."""
        for k in range(self.num_steps):
            yield self.forward_until(x, k)

    def forward_all(self, x: Tensor) -> Tensor:
        """Logits of every step, ``[K, B, C]``, cheapest first."""
        return torch.stack(list(self.steps(x)))

    def forward(self, x: Tensor) -> Tensor:
        """Same as :meth:`forward_all`."""
        return self.forward_all(x)


def count_flops(module: nn.Module, run: Callable[[Tensor], object], shape: tuple[int, ...]) -> int:
    """FLOPs of ``run`` on one zero sample of ``shape``, with ``module`` in eval mode (its mode restored)."""
    from torch.utils.flop_counter import FlopCounterMode

    sample = torch.zeros(1, *shape, device=next(module.parameters()).device)
    counter = FlopCounterMode(display=False)
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), counter:
            run(sample)
    except RuntimeError as exc:  # e.g. a cut or a slice whose shapes no longer fit together
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise AnytimeError(f"this configuration of {type(module).__name__} does not run ({first})") from None
    finally:
        module.train(was_training)
    return int(counter.get_total_flops())
