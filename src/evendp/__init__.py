"""evendp: data-parallel training that uses every device's memory and speed to the full,
with the gradient a single huge device would compute on the whole batch.

The public API is what ``__all__`` lists; everything else lives in private modules.
"""

from ._dp import BalancedDataParallel, ParallelCriterion, Scattered, gather
from ._errors import EvendpError, PlanError
from ._split import split_sizes

__all__ = [
    "BalancedDataParallel",
    "EvendpError",
    "ParallelCriterion",
    "PlanError",
    "Scattered",
    "gather",
    "split_sizes",
]

__version__ = "0.1.0"
