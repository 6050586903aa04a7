"""How a pruned run starts and goes on: a new lottery ticket (a mask over the dense run's rewound weights) or
structured ticket (the dense run's network cut to its kept channels), or a resumed one's mask or channel plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from anytime.data.base import DatasetInfo
from anytime.errors import AnytimeError
from anytime.train.channels import ChannelPlan, shrink
from anytime.train.config import TrainConfig
from anytime.train.pruning import Mask, make_channel_ticket, make_ticket


@dataclass(frozen=True)
class RunTicket:
    """What a pruned run carries: its mask (a lottery ticket) or channel plan (a structured one), the dense run it
    came from, and the state training starts from (the dense run's rewound epoch, or the run's own checkpoint)."""

    source: dict[str, Any] | None
    mask: Mask | None = None
    plan: ChannelPlan | None = None
    dense_run: str | None = None
    dense_parameters: int | None = None


def run_ticket(cfg: TrainConfig, model: nn.Module, state: dict[str, Any] | None, info: DatasetInfo,
           checkpoint: Path) -> RunTicket:  # fmt: skip
    """A pruned run's mask or channel plan (the model is shrunk to the plan's channels), from its dense run for
    a new ticket or from the checkpoint for a resumed one."""
    if state is None and cfg.prune_from is not None and cfg.prune_unit == "channels":
        # a structured ticket: the dense run's rewound weights cut to the kept channels, a smaller network
        structured = make_channel_ticket(model, cfg.prune_from, sparsity=cfg.sparsity, reset_epoch=cfg.reset_epoch,
                                         scope=cfg.prune_scope, input_shape=(info.in_channels, *info.image_size),
                                         num_classes=info.num_classes)  # fmt: skip
        check_ticket_recipe(cfg, structured.rewind["config"], structured.dense_run)
        model.load_state_dict(structured.rewind["model"])
        shrink(model, structured.plan)
        # the momentum of removed channels has no place in the smaller network: the optimiser starts afresh
        return RunTicket({**structured.rewind, "model": model.state_dict(), "optimizer": None},
                       plan=structured.plan, dense_run=str(structured.dense_run),
                       dense_parameters=structured.dense_parameters)  # fmt: skip
    if state is None and cfg.prune_from is not None:  # a lottery ticket: prune, then rewind to the dense run
        ticket = make_ticket(model, cfg.prune_from, sparsity=cfg.sparsity, reset_epoch=cfg.reset_epoch,
                             scope=cfg.prune_scope)  # fmt: skip
        check_ticket_recipe(cfg, ticket.rewind["config"], ticket.dense_run)
        return RunTicket(ticket.rewind, mask=ticket.mask, dense_run=str(ticket.dense_run))
    if state is not None and "mask" in state:
        return RunTicket(state, mask=Mask({name: keep.bool() for name, keep in state["mask"].items()}),
                       dense_run=str(state.get("dense_run", cfg.prune_from)))  # fmt: skip
    if state is not None and "channels" in state:
        plan = ChannelPlan.from_dict(state["channels"], str(checkpoint))
        shrink(model, plan)
        return RunTicket(state, plan=plan, dense_run=str(state.get("dense_run", cfg.prune_from)),
                       dense_parameters=state.get("dense_parameters"))  # fmt: skip
    return RunTicket(state)


def check_ticket_recipe(config: TrainConfig, dense: dict[str, Any], dense_run: Path) -> None:
    """A ticket trains on with its dense run's recipe: refuse one that differs in more than the ticket's own
    settings and the speed-only ones."""
    current = config.to_dict()
    saved = TrainConfig.from_dict(dense).to_dict()
    free = {*TrainConfig.RUNTIME_FIELDS, "prune_from", "sparsity", "reset_epoch", "prune_scope", "prune_unit"}
    differing = [f"{key}={current[key]!r} (dense run has {saved[key]!r})" for key in current
                 if key not in free and saved.get(key) != current[key]]  # fmt: skip
    if differing:
        raise AnytimeError(f"a ticket trains on with the recipe of its dense run {dense_run}, but these differ: "
                           f"{'; '.join(differing)}; use the dense run's recipe")  # fmt: skip
