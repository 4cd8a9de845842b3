"""Speed balance: move samples from slow ranks to fast ones at step boundaries.

Memory decides how much each rank *can* hold; speed decides how much it *should* hold. In DDP
every step waits for the slowest rank, so step time is ``max_i (a_i n_i + c_i)``: rank ``i``'s
local work takes ``a_i`` seconds per sample plus ``c_i`` per step whatever its size (the model
of Cannikin and LB-BSP); the communication no rank hides is the same for all, so it moves no
sample. The global batch never changes and ``ddp_loss`` weights each rank by its sample
count, so the gradient stays the exact full-batch gradient whatever the split.
"""

from __future__ import annotations

import heapq
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from .._core._errors import EvendpError, InputError
from .._core._validate import (
    shown,
    validate_float,
    validate_int,
    validate_numbers,
    validate_sequence,
)
from .._distributed._batch_plan import (
    ENV_BATCH_SIZES,
    MAX_BATCH,
    MAX_RANKS,
    BatchPlan,
)
from .._distributed._group import comm_device, rank_cuda_device, world_size

__all__ = ["SpeedBalancer", "balance_sizes", "fit_step_time"]

#: How many of a rank's most recent sizes the step-time model is fitted over: the re-splits
#: give new sizes, and sizes from long ago may come from another speed of the machine.
FIT_SIZES = 3


def _validate_balance_inputs(
    total: int,
    seconds_per_sample: Sequence[float],
    caps: Sequence[int] | None,
    min_size: int,
    fixed_seconds: Sequence[float] | None = None,
) -> tuple[list[float], list[int], list[float]]:
    """Check the inputs of :func:`balance_sizes`; return times, caps and fixed times as lists."""
    validate_int("total", total, minimum=1, example="256, the global batch")
    validate_sequence("seconds_per_sample", seconds_per_sample, example="[0.01, 0.02]")
    validate_numbers("caps", caps, integral=True, allow_none=True, example="caps=[16, 32]")
    times = [float(t) for t in seconds_per_sample]
    if not times:
        raise EvendpError("seconds_per_sample is empty; pass one time per rank")
    for i, t in enumerate(times):
        if not math.isfinite(t) or t <= 0:
            raise EvendpError(
                f"seconds_per_sample[{i}] = {seconds_per_sample[i]!r} is not a positive finite "
                "number; measure at least one sample on every rank"
            )
    limits = [total] * len(times) if caps is None else [int(c) for c in caps]
    if len(limits) != len(times):
        raise EvendpError(
            f"got {len(limits)} caps for {len(times)} ranks; pass one max batch per rank"
        )
    validate_int("min_size", min_size, minimum=0, example="1")
    for i, c in enumerate(limits):
        if c < min_size:
            raise EvendpError(
                f"cap {c} for rank {i} is below min_size={min_size}; raise the cap or lower "
                "min_size"
            )
    if sum(limits) < total:
        raise EvendpError(
            f"caps {limits} hold {sum(limits)} samples in all, fewer than the global batch "
            f"{total}; lower the batch or raise the caps"
        )
    if min_size * len(times) > total:
        raise EvendpError(
            f"min_size={min_size} on {len(times)} ranks needs {min_size * len(times)} samples, "
            f"more than the global batch {total}; lower min_size"
        )
    if fixed_seconds is None:
        return times, limits, [0.0] * len(times)
    validate_sequence("fixed_seconds", fixed_seconds, example="[0.0, 0.02]")
    fixed = [float(f) for f in fixed_seconds]
    if len(fixed) != len(times) or not all(math.isfinite(f) and f >= 0 for f in fixed):
        raise EvendpError(
            f"fixed_seconds={shown(fixed_seconds)}: give one non-negative finite time per rank "
            f"({len(times)}), e.g. [0.0, 0.02]"
        )
    return times, limits, fixed


def balance_sizes(
    total: int,
    seconds_per_sample: Sequence[float],
    caps: Sequence[int] | None = None,
    min_size: int = 0,
    fixed_seconds: Sequence[float] | None = None,
) -> list[int]:
    """Integer batch sizes that minimize ``max_i (n_i * t_i + f_i)`` with ``sum n_i == total``.

    ``t_i`` is rank ``i``'s seconds per sample, ``f_i`` (``fixed_seconds``, default 0) its
    seconds per step whatever its size (the optimizer step, a launch overhead). Each rank gets
    between ``min_size`` and ``caps[i]`` samples (its memory limit; no limit when ``caps`` is
    ``None``). Water-filling gives the continuous optimum, its floor is topped up one sample
    at a time to the rank that would finish soonest, which is optimal for identical samples
    on ranks of different speed. Ties go to the lower rank.

    >>> balance_sizes(30, [1.0, 2.0])      # rank 1 is half as fast
    [20, 10]
    >>> balance_sizes(30, [1.0, 2.0], caps=[16, 32])  # rank 0 cannot hold 20
    [16, 14]
    >>> balance_sizes(8, [1.0, 1.0, 1.0])
    [3, 3, 2]
    >>> balance_sizes(32, [1.0, 1.0], fixed_seconds=[0.0, 20.0])  # rank 1's slow optimizer
    [26, 6]
    """
    times, limits, fixed = _validate_balance_inputs(
        total, seconds_per_sample, caps, min_size, fixed_seconds
    )

    def size_at(level: float, i: int) -> float:
        return min(limits[i], max(min_size, (level - fixed[i]) / times[i]))

    # Bisect the common finish time at which the clamped continuous sizes hold `total`.
    ranks = range(len(times))
    low = 0.0
    high = max(c * t + f for t, c, f in zip(times, limits, fixed, strict=True)) + max(times)
    for _ in range(100):
        mid = (low + high) / 2
        low, high = (mid, high) if sum(size_at(mid, i) for i in ranks) < total else (low, mid)
    sizes = [math.floor(size_at(low, i)) for i in ranks]
    # Top up greedily: the next sample goes where it finishes first.
    heap = [((n + 1) * times[i] + fixed[i], i) for i, n in enumerate(sizes) if n < limits[i]]
    heapq.heapify(heap)
    for _ in range(total - sum(sizes)):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        if sizes[i] < limits[i]:
            heapq.heappush(heap, ((sizes[i] + 1) * times[i] + fixed[i], i))
    return sizes


def fit_step_time(points: Mapping[int, float]) -> tuple[float, float] | None:
    """``(a, c)`` of ``t(n) = a * n + c`` fitted by least squares to one rank's median step
    seconds ``points[n]`` at each size ``n`` it ran; ``None`` with fewer than two sizes.

    ``c`` is kept at 0 or more and ``a`` above 0 (else the noise won: the per-sample rate
    through the origin then); sizes within 10% of each other are too close to tell ``c``
    from noise (``None``).

    >>> fit_step_time({16: 0.036, 10: 0.030})  # 1 ms a sample, 20 ms a step
    (0.001, 0.02)
    >>> fit_step_time({16: 0.016}) is None
    True
    """
    sizes = [n for n in points if n > 0]
    if len(sizes) < 2 or max(sizes) - min(sizes) < 0.1 * max(sizes):
        return None
    mean_n = statistics.fmean(sizes)
    mean_t = statistics.fmean(points[n] for n in sizes)
    spread = sum((n - mean_n) ** 2 for n in sizes)
    slope = sum((n - mean_n) * (points[n] - mean_t) for n in sizes) / spread
    intercept = mean_t - slope * mean_n
    if slope <= 0 or intercept < 0:  # noise: the per-sample rate through the origin
        return sum(points[n] for n in sizes) / sum(sizes), 0.0
    return round(slope, 12), round(intercept, 12)


def _checked_state(
    state: Mapping[str, Any],
) -> tuple[list[int], int, list[list[float]], list[tuple[int, list[int]]]]:
    """A saved balancer state, of the kinds :meth:`SpeedBalancer.state_dict` writes (it is read
    back from a file: data to check, whoever wrote it)."""

    def ints(field: str, value: Any) -> list[int]:
        if not isinstance(value, list) or len(value) > MAX_RANKS:
            raise InputError(f"{field}: must be a list of at most {MAX_RANKS} ints")
        if not all(isinstance(v, int) and 0 <= v <= MAX_BATCH for v in value):
            raise InputError(f"{field}: must hold ints in [0, {MAX_BATCH}], got {shown(value)}")
        return [int(v) for v in value]

    sizes = ints("batch_sizes", state.get("batch_sizes"))
    steps = state.get("steps")
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 0:
        raise InputError(f"steps: must be a non-negative int, got {shown(steps)}")
    recent = state.get("recent")
    if not isinstance(recent, list) or len(recent) > MAX_RANKS:
        raise InputError(f"recent: must be a list per rank, got {shown(recent)}")
    for times in recent:
        ok = isinstance(times, list) and len(times) <= 10_000
        if not ok or not all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in times):
            raise InputError(f"recent: must hold positive seconds per sample, got {shown(times)}")
    history = state.get("history")
    if not isinstance(history, list) or len(history) > 1_000_000:
        raise InputError(f"history: must be a list of [step, sizes], got {shown(history)}")
    changes: list[tuple[int, list[int]]] = []
    for entry in history:
        if not (isinstance(entry, list | tuple) and len(entry) == 2 and isinstance(entry[0], int)):
            raise InputError(f"history: must hold [step, sizes] pairs, got {shown(entry)}")
        changes.append((int(entry[0]), ints("history sizes", entry[1])))
    if not changes or changes[0][0] != 0:
        raise InputError("history: must start with the split of step 0")
    return sizes, steps, [list(t) for t in recent], changes


def _validate_knobs(warmup: int, every: int, window: int, tolerance: float) -> None:
    validate_int("warmup", warmup, minimum=1, example="5 steps measured first")
    validate_int("every", every, minimum=1, example="10 steps between exchanges")
    validate_int("window", window, minimum=1, example="3 exchanges the median is taken over")
    validate_float("tolerance", tolerance, minimum=0, example="tolerance=0.05")
    if not 0 <= tolerance < 1:
        raise EvendpError(
            f"tolerance must be in [0, 1) (the least predicted gain worth a change), "
            f"got {tolerance!r}"
        )


class SpeedBalancer:
    """Re-split each step's global batch by measured speed, within memory caps.

    Wrap the part of each step that does not wait on other ranks (the forward and the local
    loss; not ``backward()`` under DDP, whose gradient all-reduce waits for the slowest rank)
    in ``with balancer.measure(n):`` where ``n`` is this rank's sample count, and call
    ``balancer.step()`` once per step on every rank: when it returns True the next steps take
    :attr:`batch_sizes`, which the loop applies (``sampler.set_batch_sizes``). The balancer
    decides the split; it holds no sampler. Every ``every`` steps the ranks exchange
    their timings (one ``all_gather`` of two numbers, started at one exchange and read at the
    next, so no rank waits for it), take each rank's median step time at each of its last
    sizes over the last ``window`` exchanges (one step slowed by the OS or a page fault is
    ignored; a lasting change wins after ``window // 2 + 1`` exchanges), fit ``a n + c`` to
    them (:meth:`step_model`), and from step ``warmup`` on, apply :func:`balance_sizes` when
    it predicts a step at least ``tolerance`` faster than the current split. Every rank
    computes the same sizes from the same gathered numbers, so all apply the same list at the
    same step. The first step's timing is dropped (it pays one-off allocation and warm-up
    costs). ``on_resplit`` (e.g. ``sampler.set_batch_sizes``) is called with each new split,
    for a loop that applies it in one place (the integrations' helpers do).

    ``caps``: the most samples each rank's memory holds (from ``evendp.plan`` or measured).
    ``None`` reads them from the caps ``evendp launch --model`` writes into
    ``EVENDP_BATCH_SIZES`` (``"3,5;caps=48,24"``), so speed never moves a rank past its
    memory; with no caps there is no limit.
    ``min_size`` keeps every rank busy enough to be measured. ``gather``: how the timings
    are exchanged when not by one ``all_gather`` over ``group``: a function from this rank's
    ``(seconds, samples)`` to every rank's, in rank order (a framework's own gather, or
    timings measured elsewhere).

    >>> slow_rank_1 = lambda mine: [(0.4, 4), (1.2, 4)]  # rank 1 three times slower
    >>> balancer = SpeedBalancer([4, 4], warmup=2, gather=slow_rank_1)
    >>> [balancer.step() for _ in range(3)]  # step 1 dropped, 2 re-splits, 3 keeps it
    [False, True, False]
    >>> balancer.batch_sizes
    [6, 2]
    """

    #: A balancer that acts (``evendp._planning._balance.NoBalance`` is the one that does not).
    active = True

    def __init__(
        self,
        batch_sizes: Sequence[int],
        caps: Sequence[int] | None = None,
        *,
        warmup: int = 3,
        every: int = 1,
        window: int = 5,
        tolerance: float = 0.05,
        min_size: int = 1,
        group: Any = None,
        gather: Callable[[tuple[float, float]], Sequence[tuple[float, float]]] | None = None,
        on_resplit: Callable[[list[int]], None] | None = None,
    ) -> None:
        _validate_knobs(warmup, every, window, tolerance)
        if gather is not None and not callable(gather):
            raise EvendpError(
                f"gather must be a function (seconds, samples) -> every rank's pairs, or None "
                f"(one all_gather over group), got {gather!r}"
            )
        if on_resplit is not None and not callable(on_resplit):
            raise EvendpError(
                f"on_resplit must be a function of the new split (e.g. sampler.set_batch_sizes) "
                f"or None, got {on_resplit!r}"
            )
        validate_numbers("batch_sizes", batch_sizes, integral=True, example="sampler.batch_sizes")
        sizes = [int(n) for n in batch_sizes]
        if sum(sizes) < 1:
            raise EvendpError(
                f"batch_sizes={shown(sizes)} holds no sample; give one size per rank, at least "
                "one sample in all (e.g. sampler.batch_sizes)"
            )
        self._on_resplit = on_resplit
        self._sizes = sizes
        self.total = sum(sizes)
        self.world_size = len(sizes)
        source = ""
        if caps is None:
            plan = BatchPlan.from_env(self.world_size)
            caps = None if plan is None else plan.caps
            source = f" (from {ENV_BATCH_SIZES}, set by evendp launch --model)" if caps else ""
        # Validate caps and min_size against the global batch once, up front.
        try:
            _validate_balance_inputs(self.total, [1.0] * self.world_size, caps, min_size)
        except EvendpError as exc:
            raise EvendpError(f"{exc}{source}") from None
        self.caps = None if caps is None else [int(c) for c in caps]
        self.warmup, self.every = warmup, every
        self.window, self.tolerance, self.min_size = window, tolerance, min_size
        self.group, self.gather = group, gather
        self.seconds_per_sample: list[float | None] = [None] * self.world_size
        self._recent: list[deque[float]] = [deque(maxlen=window) for _ in range(self.world_size)]
        # Per rank, its recent step seconds at each of its last FIT_SIZES sizes (the model's
        # points; not saved: a resumed run learns them again from its next re-split).
        self._points: list[dict[int, deque[float]]] = [{} for _ in range(self.world_size)]
        self._timed_steps = 0  # steps measured since the last exchange
        # The gather started at the last exchange: (every rank's figures, its work, steps).
        self._gathering: tuple[list[torch.Tensor], Any, int] | None = None
        self.steps = 0
        self.history: list[tuple[int, list[int]]] = [(0, sizes)]
        self._seconds = 0.0
        self._samples = 0
        self._events: list[tuple[Any, Any]] = []  # (start, end) CUDA events, GPU only
        # The next step is this process's first (a run's, or a resumed run's): not measured.
        self._first = True

    @contextmanager
    def measure(self, samples: int) -> Iterator[None]:
        """Time the block as this rank's compute for ``samples`` samples of this step."""
        if not torch.cuda.is_initialized():
            start = time.perf_counter()
            try:
                yield
            finally:
                self.record(time.perf_counter() - start, samples)
            return
        # --- GPU-only path. CUDA runs asynchronously, so a host timer would see only the
        # launches; events time the device work without stalling the host every step, and
        # are read (one wait) when the timings are exchanged.
        # On the rank's own GPU's stream (its communication device under NCCL): the current
        # device may still be cuda:0 on a rank that never called set_device, whose events
        # would time another rank's work (~0 s).
        device = comm_device(self.group)
        stream = torch.cuda.current_stream(device if device.type == "cuda" else rank_cuda_device())
        begin = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        begin.record(stream)
        try:
            yield
        finally:
            end.record(stream)
            self._events.append((begin, end))
            self._samples += int(samples)

    def record(self, seconds: float, samples: int) -> None:
        """Add ``seconds`` of compute for ``samples`` samples to this step (manual timing)."""
        self._seconds += float(seconds)
        self._samples += int(samples)

    def _exchange(self, steps: int) -> tuple[list[tuple[float, float]], int] | None:
        """Every rank's ``(seconds, samples)`` over ``steps`` steps, and that step count.

        Over a process group the gather is started now and read at the next exchange (its
        figures one exchange old, the same on every rank): a gather waited for at once would
        make every rank wait for the slowest one's optimizer step after each step, which a
        step otherwise overlaps with the others' next forward (a rank with a slow optimizer
        step paid it in full, in ``benchmarks/split_model.py`` before this). ``None``: nothing
        gathered yet.
        """
        mine = (self._seconds, float(self._samples))
        if self.gather is not None:
            return [(float(s), float(n)) for s, n in self.gather(mine)], steps
        world = world_size(self.group)
        if world == 1:
            return [mine], steps
        local = torch.tensor(list(mine), dtype=torch.float64, device=comm_device(self.group))
        parts = [torch.empty_like(local) for _ in range(world)]
        started = dist.all_gather(parts, local, group=self.group, async_op=True)
        gathered, self._gathering = self._gathering, (parts, started, steps)
        if gathered is None:
            return None
        before, work, counted = gathered
        work.wait()
        return [(float(p[0]), float(p[1])) for p in before], counted

    @property
    def batch_sizes(self) -> list[int]:
        """The split the next steps take (a copy): the starting sizes, a loaded checkpoint's,
        or the last re-split's."""
        return list(self._sizes)

    def step(self) -> bool:
        """Close this step's measurement; maybe re-split. True when :attr:`batch_sizes`
        changed: the loop applies them from its next step."""
        self.steps += 1
        if self._first:
            # Drop this process's first step whatever `every` is: one-off costs (allocations,
            # first kernels) would mislead. Every rank drops the same step, so every rank still
            # exchanges at the same steps.
            self._first = False
            self._events.clear()
            self._seconds, self._samples = 0.0, 0
            return False
        self._timed_steps += 1
        if self.steps % self.every:
            return False
        for begin, end in self._events:  # GPU only: the blocks timed since the last exchange
            end.synchronize()
            self._seconds += begin.elapsed_time(end) / 1000  # milliseconds -> seconds
        self._events.clear()
        exchanged = self._exchange(self._timed_steps)
        self._seconds, self._samples, self._timed_steps = 0.0, 0, 0
        if exchanged is None:
            return False
        timings, steps = exchanged
        if len(timings) != self.world_size:
            raise EvendpError(
                f"the process group has {len(timings)} ranks but the balancer has "
                f"{self.world_size} batch sizes; start it from one size per rank"
            )
        for i, (seconds, samples) in enumerate(timings):
            if samples > 0 and seconds > 0:
                self._recent[i].append(seconds / samples)
                self.seconds_per_sample[i] = statistics.median(self._recent[i])
                self._add_point(i, round(samples / steps), seconds / steps)
        return self._rebalance()

    def _add_point(self, rank: int, size: int, seconds: float) -> None:
        points = self._points[rank]
        if size in points:
            points[size] = points.pop(size)  # the most recently run size goes last
        else:
            if len(points) == FIT_SIZES:
                del points[next(iter(points))]  # the size run longest ago goes
            points[size] = deque(maxlen=self.window)
        points[size].append(seconds)

    def step_model(self) -> list[tuple[float, float]] | None:
        """Each rank's ``(seconds per sample, fixed seconds per step)``, ``t(n) = a n + c``,
        fitted to the step times at the sizes it ran (:func:`fit_step_time`); a rank seen
        at one size so far gets its per-sample rate and no fixed part. ``None`` until every
        rank was measured."""
        if any(t is None for t in self.seconds_per_sample):
            return None
        model = []
        for rate, points in zip(self.seconds_per_sample, self._points, strict=True):
            fit = fit_step_time({n: statistics.median(d) for n, d in points.items()})
            model.append(fit if fit is not None else (float(rate or 0.0), 0.0))
        return model

    def sizes_at(self, step: int) -> list[int]:
        """The per-rank sizes step ``step`` (1-based, counted by :meth:`step`) was split into.

        >>> b = SpeedBalancer([4, 4])
        >>> b.history.append((2, [6, 2]))  # re-split after step 2
        >>> [b.sizes_at(s) for s in (1, 2, 3)]
        [[4, 4], [4, 4], [6, 2]]
        """
        return list(next(sizes for done, sizes in reversed(self.history) if done < step))

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to go on with the split it had, without measuring again
        from the start: the current sizes, the steps taken, each rank's recent seconds per
        sample and the history of splits.

        >>> sorted(SpeedBalancer([4, 4]).state_dict())
        ['batch_sizes', 'history', 'recent', 'steps']
        """
        return {
            "batch_sizes": self.batch_sizes,
            "steps": self.steps,
            "recent": [list(times) for times in self._recent],
            "history": [[done, list(sizes)] for done, sizes in self.history],
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> str | None:
        """Go on from a saved :meth:`state_dict`: its split is :attr:`batch_sizes`, for the
        loop to apply from the next step (``on_resplit`` is called with it).

        A split saved for another number of ranks, another global batch or past this run's
        memory caps is not applied (the returned note says so; the run starts from its
        configured split); a malformed one is an :class:`~evendp.InputError` (a ``ValueError``)
        and changes nothing.

        >>> b = SpeedBalancer([4, 4])
        >>> b.load_state_dict({"batch_sizes": [6, 2], "steps": 5, "recent": [[0.1], [0.3]],
        ...                    "history": [[0, [4, 4]], [3, [6, 2]]]})
        >>> b.batch_sizes, b.steps, b.seconds_per_sample
        ([6, 2], 5, [0.1, 0.3])
        >>> b.load_state_dict({"batch_sizes": [3, 3, 2], "steps": 5, "recent": [],
        ...                    "history": [[0, [3, 3, 2]]]})  # doctest: +ELLIPSIS
        'the saved speed split [3, 3, 2] is for 3 ranks and a global batch of 8, this run has 2...'
        """
        sizes, steps, recent, history = _checked_state(state_dict)
        why = self._misfit(sizes)
        if why:
            return f"the saved speed split {sizes} {why}: not applied, the split is measured again"
        if len(recent) != self.world_size:
            raise InputError(f"recent: must hold one list per rank, got {len(recent)}")
        self._resplit(sizes)
        self._gathering = None  # figures gathered before the load are not this run's
        self.steps = steps
        self._recent = [deque(times, maxlen=self.window) for times in recent]
        self.seconds_per_sample = [statistics.median(d) if d else None for d in self._recent]
        self.history = history
        return None

    def _misfit(self, sizes: list[int]) -> str:
        """Why a saved split does not fit this run (empty: it fits)."""
        if len(sizes) != self.world_size or sum(sizes) != self.total:
            return (
                f"is for {len(sizes)} ranks and a global batch of {sum(sizes)}, this run has "
                f"{self.world_size} and {self.total}"
            )
        caps = self.caps or [self.total] * self.world_size
        if any(not self.min_size <= n <= c for n, c in zip(sizes, caps, strict=True)):
            return f"is outside this run's bounds ({self.min_size} to caps {caps})"
        return ""

    def _rebalance(self) -> bool:
        model = self.step_model()
        if self.steps < self.warmup or model is None:
            return False
        rates, fixed = [a for a, _ in model], [c for _, c in model]
        current = self.batch_sizes
        proposed = balance_sizes(self.total, rates, self.caps, self.min_size, fixed)

        def slowest(sizes: list[int]) -> float:  # the step's predicted time
            return max(n * a + c for n, (a, c) in zip(sizes, model, strict=True))

        now, then = slowest(current), slowest(proposed)
        # Hysteresis: a change must promise a real gain, so timing noise cannot make the
        # split flip back and forth.
        if proposed == current or then > now * (1 - self.tolerance):
            return False
        self._resplit(proposed)
        self.history.append((self.steps, proposed))
        return True

    def _resplit(self, sizes: list[int]) -> None:
        self._sizes = list(sizes)
        if self._on_resplit is not None:
            self._on_resplit(list(sizes))
