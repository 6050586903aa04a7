"""anytime: anytime-inference research in PyTorch.

Models that answer at several points of cost, measured on the device that runs them.
The public API is small; everything else lives in the sub-packages.
"""

from __future__ import annotations

from anytime.errors import AnytimeError
from anytime.utils.lazy import lazy_exports

_EXPORTS = {
    name: module
    for module, names in {
        "anytime.backbones": ("create_model", "list_models"),
        "anytime.scheduler": ("AnytimeRunner", "DeadlineScheduler"),
        "anytime.families": ("BlockDropLadder", "attach_exits", "slice_model"),
    }.items()
    for name in names
}
__all__ = sorted(_EXPORTS) + ["AnytimeError"]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__version__ = "0.1.0"
