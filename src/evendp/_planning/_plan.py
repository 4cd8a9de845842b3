"""The memory planner: what every device will hold for a step, and the split that fills them.

Three parts, each usable on its own:

- :mod:`._measure`: one training step on fake tensors (``FakeTensorMode`` + ``MemTracker``),
  memory by kind at a few batch sizes; no real memory is touched.
- :mod:`._solve`: pure arithmetic over the measured memory curves: the per-device caps, the
  largest global batch, the split that fills the devices, the even split to compare with.
- :mod:`._result`: :class:`Plan` and :class:`DevicePlan`, as a table, JSON or a chart.

:mod:`._planner` ties them together: measure, solve, measure where the answer landed, solve
again.
"""

from ._measure import profile_step
from ._planner import auto_weights, plan
from ._result import KINDS, DevicePlan, Plan

__all__ = ["KINDS", "DevicePlan", "Plan", "auto_weights", "plan", "profile_step"]
