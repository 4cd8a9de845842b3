"""The solver: pure arithmetic over measured memory curves (no model runs here).

Peak memory as a function of the batch size is the maximum over moments of an affine
function of it, so it is convex (what that means for the curves: :class:`Curve`).

What it counts per device (the design's memory model): parameters, gradients, optimizer state,
activations, outputs; on the DP output device the gathered outputs, their gradient and the
loss computed there; DDP's gradient buckets; on CUDA devices the caching allocator's bytes
beyond the tensors (the kind ``allocator``, from :mod:`._allocator`: workspaces, segments,
fragmentation); and a fixed allowance for the CUDA context, which a fake run cannot see.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .._core._errors import PlanError
from .._core._units import format_bytes

__all__ = [
    "Curve",
    "MemoryModel",
    "Mode",
    "Segment",
    "cut_spans",
    "expand",
    "solve_spans",
    "token_fit",
]

Mode = Literal["dp", "ddp"]


class Curve:
    """Bytes by kind as a function of batch size: piecewise linear through measured points,
    extended beyond them along the outermost segment.

    For a convex peak the chord between two measured sizes is an upper bound there, but the
    outermost chord extended past the last measured size is a *lower* bound: the planner
    measures any size it is about to recommend beyond the range, and flags a plan that
    still rests on extrapolation.

    >>> c = Curve({2: {"act": 20.0}, 4: {"act": 40.0}})
    >>> c.at(3)["act"], c.at(8)["act"], c.slope()
    (30.0, 80.0, 10.0)
    """

    def __init__(self, points: dict[int, dict[str, float]]) -> None:
        self.points = dict(sorted(points.items()))

    def at(self, n: float) -> dict[str, float]:
        xs = list(self.points)
        if len(xs) == 1:
            return dict(self.points[xs[0]])
        i = min(max(1, bisect.bisect_left(xs, n)), len(xs) - 1)  # the segment holding n
        x0, x1 = xs[i - 1], xs[i]
        a, b = self.points[x0], self.points[x1]
        w = (n - x0) / (x1 - x0)
        return {k: a.get(k, 0.0) + w * (b.get(k, 0.0) - a.get(k, 0.0)) for k in a.keys() | b}

    def slope(self) -> float:
        """Total bytes per sample on the outermost segment."""
        xs = list(self.points)
        if len(xs) < 2:
            return 0.0
        a, b = self.points[xs[-2]], self.points[xs[-1]]
        return (sum(b.values()) - sum(a.values())) / (xs[-1] - xs[-2])


@dataclass
class MemoryModel:
    """Per-device memory as a function of its own samples ``n`` and the global batch ``N``."""

    mode: Mode
    output_device: int
    static: dict[str, float]
    replica: Curve
    forward_end: Curve
    outputs: Curve  # bytes of one replica's outputs
    gathered: Curve | None  # output device, at N (None: no criterion there)
    gathered_held: Curve | None
    buckets: int
    context: int

    def breakdown(self, i: int, n: int, total: int) -> dict[str, float]:
        """Bytes by kind on device ``i`` at its peak phase."""
        s = self.static
        opt_phase: dict[str, float] = {
            "params": s["params"],
            "grads": s["grads"],
            "optimizer": s["optimizer"] + s["optimizer_extra"],
        }
        if self.mode == "ddp":
            fwbw = {**self.replica.at(n), "optimizer": s["optimizer"], "buckets": self.buckets}
            opt_phase.update(outputs=self.outputs.at(n).get("bytes", 0.0), buckets=self.buckets)
            phases: list[dict[str, float]] = [fwbw, opt_phase]
        else:
            master, out_dev = i == 0, i == self.output_device
            if n > 0:
                fwbw, fend = self.replica.at(n), self.forward_end.at(n)
            elif master:
                fwbw = fend = {"params": float(s["params"])}
            else:
                fwbw = fend = {}
            if master:
                fwbw = {**fwbw, "optimizer": s["optimizer"]}
                fend = {**fend, "optimizer": s["optimizer"]}
            phases = [fwbw]
            held: dict[str, float] = {}
            if out_dev:
                if self.gathered is not None and self.gathered_held is not None:
                    phases.append(_add(fend, self.gathered.at(total)))
                    held = self.gathered_held.at(total)
                else:  # loss inside the model: DP gathers the outputs, nothing flows back
                    o = self.outputs.at(total).get("bytes", 0.0) * (1 if n or total else 0)
                    held = {"gathered_outputs": o}
                phases[0] = _add(fwbw, held)
            if master:
                after = {k: v for k, v in held.items() if k != "gathered_grad"}
                reduce: dict[str, float] = {
                    "params": s["params"],
                    "optimizer": s["optimizer"],
                    "grads": 2 * s["grads"],  # replica 0's grads + their reduced sum
                }
                phases += [_add(reduce, after), _add(opt_phase, after)]
        best = max(phases, key=lambda p: sum(p.values()))
        return {**best, "cuda_context": float(self.context)}

    def peak(self, i: int, n: int, total: int) -> float:
        return sum(self.breakdown(i, n, total).values())


def _add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in a.keys() | b}


def _largest(fits: Callable[[int], bool], hi_hint: int = 1) -> int:
    """Largest n >= 0 with ``fits(n)`` for a monotone ``fits``; -1 when not even 0 fits."""
    if not fits(0):
        return -1
    lo, hi = 0, max(1, hi_hint)
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > (1 << 40) + 4 * hi_hint:  # past any device's memory (the hint: a fleet's)
            raise PlanError("the planned batch is unbounded: the model uses no memory per sample")
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


@dataclass(frozen=True)
class Segment:
    """``count`` consecutive devices from ``start`` with one answer each. A *span* is a
    segment before solving (answers 0): devices the solver cannot tell apart, the same budget
    and role (DP's device 0 and output device are their own); the answer cuts it where the
    split or the even split changes value."""

    start: int
    count: int
    budget: int
    split: int = 0
    alone: int = 0
    even: int = 0
    cap: int = 0


def cut_spans(model: MemoryModel, budgets: list[tuple[int, int]]) -> list[Segment]:
    """Spans from runs of ``(budget, count)``, cut so DP's device 0 and output device stand
    alone (their peaks differ from the other replicas')."""
    special = {0, model.output_device} if model.mode == "dp" else set()
    spans: list[Segment] = []
    start = 0
    for budget, count in budgets:
        cuts = sorted({start, start + count} | {c for i in special for c in (i, i + 1)})
        cuts = [c for c in cuts if start <= c <= start + count]
        spans += [Segment(a, b - a, budget) for a, b in itertools.pairwise(cuts) if b > a]
        start += count
    return spans


def expand(segments: list[Segment], name: str) -> list[int]:
    """One field of every segment, one entry per device."""
    out: list[int] = []
    for seg in segments:
        out += [getattr(seg, name)] * seg.count
    return out


def solve_spans(model: MemoryModel, spans: list[Segment], batch: int | None) -> list[Segment]:
    """The largest global batch, its split, each device's most alone and the even split.

    The work is per distinct device (budget and role), not per device: a million copies of
    one card cost what one does. Each answer is the one a per-device search would give.
    """
    k = sum(s.count for s in spans)
    memo: dict[tuple[Any, ...], int] = {}

    def key(span: Segment) -> tuple[int, bool, bool]:
        i = span.start  # every device of a span has its first one's role
        return span.budget, model.mode == "dp" and i == 0, i == model.output_device

    def cap(span: Segment, total: int) -> int:
        at = (key(span), "cap", total)
        if at not in memo:
            memo[at] = _largest(
                lambda n: model.peak(span.start, n, total) <= span.budget, total or 1
            )
        return memo[at]

    def caps(total: int) -> list[int]:
        return [min(cap(s, total), total) for s in spans]

    def feasible(total: int) -> bool:
        c = caps(total)
        return min(c) >= 0 and sum(ci * s.count for ci, s in zip(c, spans, strict=True)) >= total

    def alone_cap(span: Segment) -> int:
        at = (key(span), "alone")
        if at not in memo:
            memo[at] = max(0, _largest(lambda n: model.peak(span.start, n, n) <= span.budget))
        return memo[at]

    alone = [alone_cap(s) for s in spans]
    best = _largest(feasible, max(1, sum(a * s.count for a, s in zip(alone, spans, strict=True))))
    if best < 1:
        raise PlanError(
            "not even one sample fits: "
            + "; ".join(
                f"device {s.start + j} needs {format_bytes(model.peak(s.start, 1, 1))} for "
                f"one sample, may use {format_bytes(s.budget)}"
                for s in spans
                for j in range(min(s.count, 3))  # a long run of equal devices: its first ones
            )
            + "; use devices with more free memory, a smaller model, AMP or checkpointing"
        )
    total = best if batch is None else batch
    if total > best:
        raise PlanError(
            f"a global batch of {batch} does not fit these devices, the largest that fits is "
            f"{best}: lower the batch size, add devices or free memory"
        )
    step_caps = [max(c, 0) for c in caps(total)]
    split = _capped_even_runs([(c, s.count) for c, s in zip(step_caps, spans, strict=True)], total)

    def even_fits(t: int) -> bool:
        return all(  # each span's first device stands for its role
            model.peak(spans[_span_of(spans, seg.start)].start, seg.even, t) <= seg.budget
            for seg in _even_segments(spans, t, k, memo, key)
        )

    even_total = total if batch is not None else max(0, _largest(even_fits, max(1, best)))
    segments = [
        dataclasses.replace(seg, alone=alone[i], cap=step_caps[i])
        for seg in _even_segments(spans, even_total, k, None, key)
        for i in [_span_of(spans, seg.start)]
    ]
    return _with_split(segments, split)


def _even_segments(spans: list[Segment], total: int, k: int, memo: Any, key: Any) -> list[Segment]:
    """The spans cut where the even split of ``total`` drops from ``q + 1`` to ``q``."""
    q, r = divmod(total, k)  # split_sizes(total, [1] * k): q + 1 for the first r, then q
    out = []
    for s in spans:
        end = s.start + s.count
        for a, b, size in ((s.start, min(end, r), q + 1), (max(s.start, r), end, q)):
            if b > a:
                out.append(Segment(a, b - a, s.budget, even=size))
    if memo is not None:  # even_fits: one check per distinct device and size
        seen: dict[tuple[Any, ...], Segment] = {}
        for seg in out:
            seen.setdefault((key(seg), seg.even), seg)
        out = list(seen.values())
    return out


def _span_of(spans: list[Segment], index: int) -> int:
    """The last span starting at or before ``index``."""
    return bisect.bisect_right(spans, index, key=lambda s: s.start) - 1


def _capped_even_runs(caps: list[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """Split ``total`` as evenly as the caps allow, over runs of ``(cap, count)``: runs of
    ``(size, count)``, each ``min(cap, level)`` for the lowest level that holds ``total``.

    For equally fast devices the step takes as long as the largest share, so the best split
    that fits is the even one, with a device that cannot hold its even share kept at its cap
    and the rest spread evenly over the others (speed differences are the speed balancer's
    job, at run time). The caller guarantees the caps hold ``total``.
    """
    level = _largest(lambda lv: sum(min(c, lv) * n for c, n in caps) < total, 1) + 1
    sizes = [(min(c, level), n) for c, n in caps]
    excess = sum(v * n for v, n in sizes) - total
    out: list[tuple[int, int]] = []
    for v, n in reversed(sizes):  # take the excess back from the uncapped, last first
        take = min(excess, n) if v == level else 0
        excess -= take
        out += [(v - 1, take), (v, n - take)]  # reversed below: the last devices lose one
    return [(v, n) for v, n in reversed(out) if n]


def _with_split(segments: list[Segment], split: list[tuple[int, int]]) -> list[Segment]:
    """``segments`` cut where the split's runs change value, each with its split size."""
    out: list[Segment] = []
    runs = iter(split)
    size, left = next(runs, (0, 0))
    for seg in segments:
        start, count = seg.start, seg.count
        while count:
            while left == 0:
                size, left = next(runs)
            n = min(count, left)
            out.append(dataclasses.replace(seg, start=start, count=n, split=size))
            start, count, left = start + n, count - n, left - n
    return out


def token_fit(
    peak_at: dict[tuple[int, int], float],
) -> tuple[float, float, float]:
    """Fit a replica's step bytes ``fixed + n * (per_token * w + per_token_width * w**2)``
    to three measured ``(n, w) -> bytes`` points: two batch sizes at one width, one more
    width. The ``w**2`` term is attention's score matrix (no fused kernel); it is 0 for a
    model linear in the width. Returns ``(fixed, per_token, per_token_width)``.

    >>> truth = lambda n, w: 100 + n * (8 * w + 0.5 * w * w)
    >>> token_fit({(n, w): truth(n, w) for n, w in [(2, 16), (4, 16), (4, 8)]})
    (100.0, 8.0, 0.5)
    """
    (n0, w0), (n1, w1), (n2, w2) = sorted(peak_at, key=lambda nw: (-nw[1], nw[0]))
    if w0 != w1 or n0 == n1 or w2 == w0 or n2 == 0:
        raise PlanError(f"a token fit needs two sizes at one width and a third width: {peak_at}")
    slope_long = (peak_at[(n1, w1)] - peak_at[(n0, w0)]) / (n1 - n0)  # bytes per sample at w0
    fixed = peak_at[(n0, w0)] - n0 * slope_long
    slope_short = (peak_at[(n2, w2)] - fixed) / n2
    # slope(w) = per_token * w + per_token_width * w**2, known at w0 and w2:
    per_token_width = (slope_long / w0 - slope_short / w2) / (w0 - w2)
    per_token = slope_long / w0 - per_token_width * w0
    return fixed, per_token, per_token_width
