"""Split computing with early exit (DDNN, Edgent): plan the partition point, codec and exits against a deadline and
a link, and carry requests between a device process and a server process over TCP."""

from anytime.split.codec import CODECS
from anytime.split.device import SplitAnswer, SplitDevice
from anytime.split.link import LinkError, LinkEstimator, LinkShaper, SplitClient, TokenBucket
from anytime.split.plan import Link, PlanSettings, SplitOption, SplitPlan, SplitPlanner
from anytime.split.server import SplitServer, SplitService
from anytime.split.tables import SplitTables

__all__ = [
    "CODECS", "Link", "LinkError", "LinkEstimator", "LinkShaper", "PlanSettings", "SplitAnswer", "SplitClient",
    "SplitDevice", "SplitOption", "SplitPlan", "SplitPlanner", "SplitServer", "SplitService", "SplitTables",
    "TokenBucket",
]  # fmt: skip
