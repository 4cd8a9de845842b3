"""Pure cost arithmetic: a step's samples -> per-device shares whose padded cost follows capacity.

A device's time and memory for a step grow with the tokens it holds, padded to its longest
sequence, not with its number of samples. :func:`split_by_cost` chooses shares that minimize
the bottleneck ``max_i(cost_i / capacity_i)``:

1. sort the step's samples by cost (ties by position), so similar lengths sit together and
   padding stays small;
2. for an order of the devices, a threshold ``T`` is feasible when a greedy walk gives each
   device in turn the longest run of the sorted samples whose cost is at most
   ``T * capacity`` (and within its caps) and reaches the end. The cost of a run grows with
   its end and shrinks with its start, so the greedy walk is optimal for that order, and ``T``
   is found by bisection;
3. try several device orders (every order for up to 4 devices) and keep the best.

One order tried sorts the devices by the longest sample each holds in the sample-count split:
the sorted runs of the same sizes then never hold a longer sample. Summed costs
(``padded=False``) need no grouping, so a longest-first greedy is tried beside the runs; the
sample-count split itself is the last candidate, so no plan is ever worse than it. Everything
is deterministic (ties to the first candidate and the lower position), so every rank computes
the same plan without communication.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence

from ._errors import EvendpError
from ._split import split_sizes, validate_weights
from ._validate import validate_bool

__all__ = [
    "budget_step_length",
    "padded_cost",
    "sample_costs",
    "split_by_cost",
    "validate_caps",
    "validate_costs",
]

# Orders of the devices tried: every permutation up to this many devices, else a few.
_ALL_ORDERS_UP_TO = 4
# Bisection on the threshold stops at this relative width (the plan is feasible at the top).
_RELATIVE_TOL = 1e-9
_MAX_BISECTIONS = 100


def validate_costs(costs: object) -> list[float]:
    """Return ``costs`` as floats, or raise naming the bad value and the fix."""
    tolist = getattr(costs, "tolist", None)  # a 1-D tensor or NumPy array of lengths
    if callable(tolist) and getattr(costs, "ndim", None) == 1:
        costs = tolist()
    if isinstance(costs, (str, bytes)) or not isinstance(costs, Sequence):
        raise EvendpError(
            f"costs must be a sequence of non-negative numbers (one per sample), got "
            f"{type(costs).__name__}; pass e.g. the token length of each sample"
        )
    values: list[float] = []
    for i, c in enumerate(costs):
        try:
            value = float(c)
        except (TypeError, ValueError):
            value = math.nan
        if isinstance(c, bool) or not math.isfinite(value) or value < 0:
            raise EvendpError(
                f"cost {c!r} at position {i} is not a non-negative finite number; a sample's "
                "cost is e.g. its length in tokens"
            )
        values.append(value)
    return values


def validate_caps(caps: Sequence[float] | None, devices: int, name: str) -> list[float]:
    """Per-device upper bounds (``inf`` when ``None``)."""
    if caps is None:
        return [math.inf] * devices
    if isinstance(caps, (str, bytes)) or not isinstance(caps, Sequence) or len(caps) != devices:
        raise EvendpError(
            f"{name} must be a sequence of {devices} non-negative numbers (one per device), "
            f"got {caps!r}; pass None for no limit"
        )
    values = []
    for i, cap in enumerate(caps):
        value = float(cap)
        if isinstance(cap, bool) or math.isnan(value) or value < 0:
            raise EvendpError(
                f"{name}[{i}] = {cap!r} is not a non-negative number; use math.inf for no limit"
            )
        values.append(value)
    return values


def sample_costs(data: object, length: int, costs: object) -> list[float] | None:
    """Per-sample costs from a sequence (one per sample) or a function of ``data[i]``."""
    if costs is None:
        return None
    if callable(costs):
        if isinstance(data, int) or not hasattr(data, "__getitem__"):
            raise EvendpError(
                f"costs is a function of the dataset item, but data is {data!r}, not a "
                "dataset; pass the dataset as data, or costs as a list (one number per sample)"
            )
        values = [costs(data[i]) for i in range(length)]
        try:
            return validate_costs(values)
        except EvendpError as err:
            raise EvendpError(
                f"costs({type(data).__name__}[i]) returned a bad value: {err}"
            ) from None
    checked = validate_costs(costs)
    if len(checked) != length:
        raise EvendpError(
            f"costs has {len(checked)} values for {length} samples; pass one cost per sample "
            "(e.g. [len(x) for x in texts]) or a function of the dataset item"
        )
    return checked


def budget_step_length(
    costs: Sequence[float], order: Sequence[int], budget: float, start: int = 0
) -> int:
    """How many samples of ``order`` from ``start`` on one step takes under a token budget.

    Samples are taken in order while their summed cost stays within ``budget`` (at least
    one: the caller checks no sample alone exceeds it), as fairseq's ``max_tokens``.

    >>> budget_step_length([3, 4, 2, 5], [0, 1, 2, 3], budget=9)
    3
    >>> budget_step_length([3, 4, 2, 5], [0, 1, 2, 3], budget=9, start=2)
    2
    """
    total, taken = 0.0, 0
    for k in range(start, len(order)):
        i = order[k]
        if taken and total + costs[i] > budget:
            break
        total += costs[i]
        taken += 1
    return taken


def padded_cost(costs: Sequence[float], padded: bool = True) -> float:
    """The cost of one device's share: ``len * max`` when rows are padded, else the sum.

    >>> padded_cost([3, 5, 4])
    15.0
    >>> padded_cost([3, 5, 4], padded=False)
    12.0
    >>> padded_cost([])
    0.0
    """
    values = validate_costs(costs)
    return _share_cost(values, list(range(len(values))), validate_bool("padded", padded))


class _Runs:
    """Costs of runs ``[a, b)`` of the sorted costs, and the greedy walk over devices."""

    def __init__(self, sorted_costs: list[float], padded: bool) -> None:
        self.costs = sorted_costs
        self.padded = padded
        self.prefix = [0.0, *itertools.accumulate(sorted_costs)]

    def cost(self, a: int, b: int) -> float:
        if b <= a:
            return 0.0
        # Sorted ascending, so the run's longest sample is its last.
        return (b - a) * self.costs[b - 1] if self.padded else self.prefix[b] - self.prefix[a]

    def longest_run(self, a: int, limit: float, max_size: int) -> int:
        """The largest ``b`` in ``[a, a + max_size]`` with ``cost(a, b) <= limit``."""
        ends = range(a, min(len(self.costs), a + max_size) + 1)  # cost(a, b) rises with b
        return a + bisect.bisect_right(ends, limit, key=lambda b: self.cost(a, b)) - 1

    def walk(
        self,
        order: Sequence[int],
        threshold: float,
        capacities: list[float],
        max_sizes: list[int],
        max_costs: list[float],
    ) -> list[int] | None:
        """Run sizes per device (by device index) if ``threshold`` is feasible, else None."""
        sizes = [0] * len(capacities)
        a = 0
        for device in order:
            if capacities[device] <= 0:
                continue  # a device of no capacity takes nothing, not even free samples
            limit = min(threshold * capacities[device], max_costs[device])
            b = self.longest_run(a, limit, max_sizes[device])
            sizes[device] = b - a
            a = b
        return sizes if a == len(self.costs) else None


def _orders(capacities: list[float], count_order: list[int]) -> list[list[int]]:
    """Device orders to try, first ones winning ties."""
    devices = list(range(len(capacities)))
    if len(devices) <= _ALL_ORDERS_UP_TO:
        candidates = [count_order, *map(list, itertools.permutations(devices))]
    else:
        by_capacity = sorted(devices, key=lambda d: (capacities[d], d))
        candidates = [count_order, devices, by_capacity, by_capacity[::-1]]
    return [list(order) for order in dict.fromkeys(map(tuple, candidates))]  # first ones kept


def split_by_cost(
    costs: Sequence[float],
    capacities: Sequence[float],
    *,
    padded: bool = True,
    max_sizes: Sequence[int] | None = None,
    max_costs: Sequence[float] | None = None,
) -> list[list[int]]:
    """Assign a step's samples to devices so each device's cost is in proportion to capacity.

    ``costs[j]`` is sample ``j``'s cost (its length in tokens, or ``len + len**2 / k`` for
    attention); a share costs ``len * max`` (``padded=True``, rows padded to the longest) or
    the sum. Returns, per device, the positions into ``costs`` it takes (ascending), chosen to
    minimize ``max_i(cost_i / capacities[i])`` with similar lengths grouped together. Every
    position appears once; a zero capacity gets nothing; ``max_sizes`` (samples) and
    ``max_costs`` (cost units, e.g. the padded tokens a device's memory holds) cap a share.
    Deterministic: the same inputs give the same plan on every rank.

    >>> split_by_cost([10, 1, 1, 10, 1, 1], [1, 1])  # the count split gives [10,1,1], [10,1,1]
    [[1, 2, 4, 5], [0, 3]]
    >>> split_by_cost([4, 4, 4, 4, 4, 4], [2, 1, 0])
    [[0, 1, 2, 3], [4, 5], []]
    """
    values = validate_costs(costs)
    validate_bool("padded", padded)
    weights = validate_weights(capacities)
    devices = len(weights)
    largest = max(weights)
    weights = [w / largest for w in weights]  # relative to the largest, as split_sizes does
    sizes_cap = [
        int(c) if math.isfinite(c) else len(values)
        for c in validate_caps(max_sizes, devices, "max_sizes")
    ]
    costs_cap = validate_caps(max_costs, devices, "max_costs")
    order_by_cost = sorted(range(len(values)), key=lambda j: (values[j], j))
    runs = _Runs([values[j] for j in order_by_cost], padded)
    if not values:
        return [[] for _ in range(devices)]

    count = _contiguous(split_sizes(len(values), weights))
    candidates = [_sorted_runs(values, weights, runs, order_by_cost, count, sizes_cap, costs_cap)]
    if not padded:
        # Sums need no grouping by length, and longest-first beats sorted runs on them.
        candidates.append(_longest_first(values, weights, order_by_cost, sizes_cap, costs_cap))
    if _within_caps(values, count, sizes_cap, costs_cap, padded):
        # Never worse than the sample-count split; and when nothing costs anything, cost
        # cannot tell devices apart, so the count split goes first and wins the tie.
        candidates.insert(0 if runs.cost(0, len(values)) == 0 else len(candidates), count)
    scored = [
        (_bottleneck(values, shares, weights, padded), rank, shares)
        for rank, shares in enumerate(candidates)
        if shares is not None
    ]
    if not scored:
        raise EvendpError(
            f"the step's {len(values)} samples (total cost {sum(values):g}) do not fit the caps "
            f"max_sizes={max_sizes!r}, max_costs={max_costs!r}; raise the caps or use a "
            "smaller batch"
        )
    return min(scored, key=lambda item: (item[0], item[1]))[2]


def _share_cost(values: list[float], share: list[int], padded: bool) -> float:
    if not share:
        return 0.0
    picked = [values[j] for j in share]
    return len(picked) * max(picked) if padded else sum(picked)


def _bottleneck(
    values: list[float], shares: list[list[int]], capacities: list[float], padded: bool
) -> float:
    """``max_i(cost_i / capacity_i)`` over the devices that hold samples."""
    worst = 0.0
    for share, capacity in zip(shares, capacities, strict=True):
        if share:
            worst = max(worst, _share_cost(values, share, padded) / capacity)
    return worst


def _within_caps(
    values: list[float],
    shares: list[list[int]],
    max_sizes: list[int],
    max_costs: list[float],
    padded: bool,
) -> bool:
    return all(
        len(share) <= size_cap and _share_cost(values, share, padded) <= cost_cap
        for share, size_cap, cost_cap in zip(shares, max_sizes, max_costs, strict=True)
    )


def _sorted_runs(
    values: list[float],
    capacities: list[float],
    runs: _Runs,
    order_by_cost: list[int],
    count: list[list[int]],
    max_sizes: list[int],
    max_costs: list[float],
) -> list[list[int]] | None:
    """The best split into runs of the cost-sorted samples, over several device orders."""
    # First the order that sorts the sample-count split's shares by their longest sample.
    longest = [max((values[j] for j in share), default=-1.0) for share in count]
    count_order = sorted(range(len(count)), key=lambda d: (longest[d], d))
    count_bottleneck = _bottleneck(values, count, capacities, runs.padded)
    total = runs.cost(0, len(values))
    # Feasible for any order without caps: the first device of capacity > 0 takes everything.
    upper = total / min(w for w in capacities if w > 0)
    if count_bottleneck > 0:
        upper = min(upper, count_bottleneck)
    best: tuple[float, list[tuple[int, int]]] | None = None
    for order in _orders(capacities, count_order):
        # After the first order, only a clearly better threshold is worth a bisection.
        top = upper if best is None else best[0] * (1 - _RELATIVE_TOL)
        sizes = runs.walk(order, top, capacities, max_sizes, max_costs)
        if sizes is None and best is None:
            top = math.inf  # caps may make even the bound infeasible; try without a bound
            sizes = runs.walk(order, top, capacities, max_sizes, max_costs)
        if sizes is None:
            continue
        threshold, sizes = _bisect(runs, order, top, capacities, max_sizes, max_costs, sizes)
        if best is None or threshold < best[0]:
            best = (threshold, [(device, sizes[device]) for device in order])
    if best is None:
        return None
    shares: list[list[int]] = [[] for _ in capacities]
    start = 0
    for device, size in best[1]:
        shares[device] = sorted(order_by_cost[start : start + size])
        start += size
    return shares


def _longest_first(
    values: list[float],
    capacities: list[float],
    order_by_cost: list[int],
    max_sizes: list[int],
    max_costs: list[float],
) -> list[list[int]] | None:
    """Summed costs: each sample, longest first, to the device it finishes earliest on."""
    loads = [0.0] * len(capacities)
    shares: list[list[int]] = [[] for _ in capacities]
    for j in reversed(order_by_cost):
        fits = [
            d
            for d, w in enumerate(capacities)
            if w > 0 and len(shares[d]) < max_sizes[d] and loads[d] + values[j] <= max_costs[d]
        ]
        if not fits:
            return None
        device = min(fits, key=lambda d: ((loads[d] + values[j]) / capacities[d], d))
        loads[device] += values[j]
        shares[device].append(j)
    return [sorted(share) for share in shares]


def _contiguous(sizes: list[int]) -> list[list[int]]:
    starts = [0, *itertools.accumulate(sizes)]
    return [list(range(starts[d], starts[d] + size)) for d, size in enumerate(sizes)]


def _bisect(
    runs: _Runs,
    order: Sequence[int],
    top: float,
    capacities: list[float],
    max_sizes: list[int],
    max_costs: list[float],
    sizes: list[int],
) -> tuple[float, list[int]]:
    """The smallest feasible threshold for ``order`` (to a relative tolerance) and its sizes."""
    if math.isinf(top):
        # Start from what the feasible walk actually used: the largest cost per capacity.
        start, used = 0, 0.0
        for device in order:
            if capacities[device] > 0:
                cost = runs.cost(start, start + sizes[device])
                used = max(used, cost / capacities[device])
            start += sizes[device]
        top = used
        sizes = runs.walk(order, top, capacities, max_sizes, max_costs) or sizes
    lo = 0.0
    for _ in range(_MAX_BISECTIONS):
        if top - lo <= _RELATIVE_TOL * top:
            break
        mid = (lo + top) / 2
        found = runs.walk(order, mid, capacities, max_sizes, max_costs)
        if found is None:
            lo = mid
        else:
            top, sizes = mid, found
    return top, sizes
