"""Heterogeneous ensembles as anytime ladders: members of any architecture and precision, in cost order, fused
after each one (mean, vote, weighted mean or an MLP, fit on held-out data, cross-fitted)."""

from anytime.ensembles.fusers import FUSERS, CrossFit, FitSettings, Fuser, cross_fit, fit_fuser, log_probs, make_fuser
from anytime.ensembles.model import EnsembleModel, FuserBank, MemberInfo, member_log_probs

__all__ = [
    "FUSERS", "CrossFit", "EnsembleModel", "FitSettings", "Fuser", "FuserBank", "MemberInfo", "cross_fit",
    "fit_fuser", "log_probs", "make_fuser", "member_log_probs",
]  # fmt: skip
