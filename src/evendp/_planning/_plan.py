"""The memory planner's face: :mod:`._measure` (a step on fake tensors), :mod:`._solve` (pure
arithmetic over the measured curves), :mod:`._result` (:class:`Plan`), and :mod:`._planner`,
which measures, solves, measures where the answer landed and solves again."""

from ._measure import profile_step
from ._planner import auto_weights, plan
from ._result import KINDS, DevicePlan, Plan

__all__ = ["KINDS", "DevicePlan", "Plan", "auto_weights", "plan", "profile_step"]
