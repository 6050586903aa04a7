"""Wrappers that turn a backbone into an anytime model obeying the step contract."""

from anytime.wrappers.exits import HEADS, SDN_FRACTIONS, ExitInfo, MultiExitModel, attach_exits, exit_head

__all__ = ["HEADS", "SDN_FRACTIONS", "ExitInfo", "MultiExitModel", "attach_exits", "exit_head"]
