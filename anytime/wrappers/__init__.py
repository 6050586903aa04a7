"""Wrappers that turn a backbone into an anytime model obeying the step contract."""

from anytime.wrappers.exits import GRADED, HEADS, SDN_FRACTIONS, ExitInfo, MultiExitModel, attach_exits, exit_head, head_kinds
from anytime.wrappers.residual import (
    CUT_KINDS,
    BlockDropLadder,
    apply_cuts,
    residual_blocks,
    set_stochastic_depth,
    top_down_ladder,
)
from anytime.wrappers.slicing import SLICE_KINDS, SlicedModel, slice_model

__all__ = [
    "CUT_KINDS", "GRADED", "HEADS", "SDN_FRACTIONS", "SLICE_KINDS", "BlockDropLadder", "ExitInfo", "MultiExitModel",
    "SlicedModel", "apply_cuts", "attach_exits", "exit_head", "head_kinds", "residual_blocks", "set_stochastic_depth",
    "slice_model", "top_down_ladder",
]  # fmt: skip
