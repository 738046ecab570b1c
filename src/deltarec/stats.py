"""The one quantile every output of deltarec reports (metrics, verify's report, the demo).

Nearest rank over ascending values, so a p99 is always one of the measured values and the
Prometheus gauges, the KFP metrics and the HTML report agree on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ascending values (nearest rank; the highest for q = 1).

    Raises:
        ValueError: no values, or ``q`` outside [0, 1].
    """
    if not sorted_values:
        raise ValueError("no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} is outside [0, 1]")
    rank = min(len(sorted_values), max(1, math.ceil(q * len(sorted_values))))
    return float(sorted_values[rank - 1])
