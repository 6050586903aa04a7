"""anytime: anytime-inference research in PyTorch.

Models that answer at several points of cost, measured on the device that runs them.
The public API is small; everything else lives in the sub-packages.
"""

from __future__ import annotations

from anytime.backbones import create_model, list_models
from anytime.errors import AnytimeError
from anytime.scheduler import AnytimeRunner, DeadlineScheduler
from anytime.wrappers import BlockDropLadder, attach_exits, slice_model

__all__ = [
    "AnytimeError", "AnytimeRunner", "BlockDropLadder", "DeadlineScheduler", "attach_exits", "create_model",
    "list_models", "slice_model",
]  # fmt: skip
__version__ = "0.1.0"
