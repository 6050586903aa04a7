"""Exit criteria, threshold sweeps, Pareto fronts, the oracle, and calibration for an accuracy or cost target.

Everything here reads the outputs cache (numbers, no network), except :meth:`ExitPolicy.run`, which
applies a policy to a running model.
"""

from anytime.calibrate.criteria import CRITERIA, Criterion, fit_temperatures, get_criterion
from anytime.calibrate.fit import RULES, Calibration, calibrate_budget, calibrate_max_drop, msdnet_shares
from anytime.calibrate.policy import EarlyExitOutput, ExitPolicy, PolicyResult
from anytime.calibrate.sweep import Oracle, SweepResult, oracle, sweep

__all__ = [
    "CRITERIA", "RULES", "Calibration", "Criterion", "EarlyExitOutput", "ExitPolicy", "Oracle", "PolicyResult",
    "SweepResult", "calibrate_budget", "calibrate_max_drop", "fit_temperatures", "get_criterion", "msdnet_shares",
    "oracle", "sweep",
]  # fmt: skip
