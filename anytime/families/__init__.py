"""Families of anytime steps, each a ladder of rising cost under the step contract: early exits, nested slices,
residual cutting and block skipping, resolution ladders, SACT, and heterogeneous ensembles fused after each member
(mean, vote, weighted mean or an MLP, fit on held-out data, cross-fitted). :mod:`anytime.families.registry` lists
them with an example each."""

from anytime.families.ensemble import EnsembleModel, FuserBank, MemberInfo, member_log_probs
from anytime.families.exits import (
    GRADED,
    HEADS,
    SDN_FRACTIONS,
    ExitInfo,
    MultiExitModel,
    attach_exits,
    exit_head,
    head_kinds,
)
from anytime.families.fusers import FUSERS, CrossFit, FitSettings, Fuser, cross_fit, fit_fuser, log_probs, make_fuser
from anytime.families.residual import (
    CUT_KINDS,
    BlockDropLadder,
    apply_cuts,
    residual_blocks,
    set_stochastic_depth,
    top_down_ladder,
)
from anytime.families.slicing import SLICE_KINDS, SlicedModel, slice_model

__all__ = [
    "CUT_KINDS", "FUSERS", "GRADED", "HEADS", "SDN_FRACTIONS", "SLICE_KINDS", "BlockDropLadder", "CrossFit",
    "EnsembleModel", "ExitInfo", "FitSettings", "Fuser", "FuserBank", "MemberInfo", "MultiExitModel", "SlicedModel",
    "apply_cuts", "attach_exits", "cross_fit", "exit_head", "fit_fuser", "head_kinds", "log_probs", "make_fuser",
    "member_log_probs", "residual_blocks", "set_stochastic_depth", "slice_model", "top_down_ladder",
]  # fmt: skip
