"""Exit criteria, threshold sweeps, Pareto fronts, the oracle, and calibration for an accuracy or cost target.

Everything here reads the outputs cache (numbers, no network), except :meth:`ExitPolicy.run`, which
applies a policy to a running model.
"""

from __future__ import annotations

from anytime.utils.lazy import lazy_exports

_EXPORTS = {
    name: module
    for module, names in {
        "anytime.calibrate.criteria": ("CRITERIA", "Criterion", "fit_temperatures", "get_criterion"),
        "anytime.calibrate.fit": (
            "RULES",
            "Calibration",
            "SubsetChoice",
            "calibrate_budget",
            "calibrate_max_drop",
            "measured_costs",
            "msdnet_shares",
            "select_exits",
        ),
        "anytime.calibrate.policy": ("ExitPolicy",),
        "anytime.calibrate.policy_answers": ("EarlyExitOutput", "PolicyResult"),
        "anytime.calibrate.sweeps": ("Oracle", "SweepResult", "oracle", "sweep"),
    }.items()
    for name in names
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
