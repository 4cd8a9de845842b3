"""The planner's entry points: measure a few sizes, solve, measure where the answer landed,
solve again, and report the result as a :class:`Plan`."""

from __future__ import annotations

import bisect
import contextlib
import dataclasses
import itertools
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn as nn

from .._core._amp import amp_dtype
from .._core._errors import EvendpError, PlanError
from .._core._units import parse_bytes
from .._core._validate import validate_bool, validate_callable, validate_float, validate_int
from ._allocator import CudaAllocatorModel, monotone_allocator, with_allocator
from ._measure import (
    ModelLike,
    OptimizerFactory,
    Point,
    at_width,
    make_setup,
    measure_gathered,
    measure_replica,
    planning_errors,
    sample_output,
    tensors,
    validate_batch,
)
from ._memory import DEFAULT_CONTEXT, DeviceMemory, live_memory, memory_runs
from ._on_device import Measurer, calibrated_plan, cuda_step, measurers_for, remember
from ._result import DevicePlan, DeviceRows, Plan
from ._solve import Curve, MemoryModel, Mode, Segment, cut_spans, expand, solve_spans, token_fit

__all__ = ["auto_weights", "plan", "progress_to"]
_MAX_ROUNDS = 4

#: ``plan(safety_margin=None)`` where tensors are counted (no allocator model).
DEFAULT_MARGIN = 0.05

_Say = Callable[[str], None]
#: Where the planner says what it is measuring; ``None`` (the default): silent.
_PROGRESS: ContextVar[_Say | None] = ContextVar("evendp_plan_progress", default=None)


@contextlib.contextmanager
def progress_to(say: _Say | None) -> Iterator[None]:
    """Within it, every plan passes ``say`` one short line before each fake step it measures.

    A fake step at a large size can take seconds (a big model, or a batch function that is
    slow at many rows): the rehearsal shows these lines so planning is not silent.
    """
    token = _PROGRESS.set(say)
    try:
        yield
    finally:
        _PROGRESS.reset(token)


def _note(line: str) -> None:
    say = _PROGRESS.get()
    if say is not None:
        say(f"planning: {line}")


def _validate_options(
    mode: str, safety_margin: float, output_device: int, k: int, batch_size: int | None
) -> None:
    if mode not in ("dp", "ddp"):
        raise EvendpError(f"mode must be 'dp' or 'ddp', got {mode!r}")
    validate_float("safety_margin", safety_margin, minimum=0, example="safety_margin=0.05")
    validate_int("output_device", output_device, minimum=0, example="output_device=0")
    if not 0.0 <= safety_margin < 1.0:
        raise EvendpError(f"safety_margin must be in [0, 1), got {safety_margin!r}; e.g. 0.05")
    if not 0 <= output_device < k:
        raise EvendpError(
            f"output_device {output_device!r} is not one of the {k} devices 0..{k - 1}"
        )
    validate_int("batch_size", batch_size, minimum=1, allow_none=True, example="batch_size=64")


@dataclasses.dataclass(frozen=True)
class _Fleet:
    """The devices to plan for as runs of alike ones: ``(count, free, total)`` in order, and
    their names (``None``: ``dev0``, ``dev1``, ... by position, as :func:`parse_memory`)."""

    runs: list[tuple[int, int, int | None]]
    names: list[str] | None = None

    def __len__(self) -> int:
        return sum(count for count, _, _ in self.runs)

    def name(self, i: int) -> str:
        return f"dev{i}" if self.names is None else self.names[i]

    @classmethod
    def of(cls, mems: Sequence[DeviceMemory]) -> _Fleet:
        runs = [(len(list(g)), free, total) for (free, total), g in
                itertools.groupby(mems, key=lambda m: (m.free, m.total))]  # fmt: skip
        return cls(runs, [m.name for m in mems])


def _validate_memory_specs(memory: Any) -> _Fleet:
    """``plan(memory=...)``: a spec string, sizes, ``DeviceMemory`` or ``None`` (live GPUs)."""
    if memory is None:
        return _Fleet.of(live_memory())
    if isinstance(memory, Sequence) and memory and all(isinstance(d, DeviceMemory) for d in memory):
        return _Fleet.of(memory)
    if isinstance(memory, str) or (isinstance(memory, Sequence) and memory):
        return _Fleet(memory_runs(memory))
    raise EvendpError(
        f"memory must be a spec like '24GiB,24GiB,12GiB', a list of sizes or DeviceMemory, "
        f"or None for the live GPUs; got {memory!r}"
    )


def _validate_sequence_batch(batch: Any) -> None:
    """``seq_len`` resizes the example batch's dim 1: it needs tensors with one."""
    if (callable(batch) and not isinstance(batch, torch.Tensor)) or not any(
        t.dim() >= 2 for t in tensors(batch)
    ):
        raise EvendpError(
            f"seq_len needs an example batch of tensors with a sequence dimension (dim 1), "
            f"got {type(batch).__name__}; pass e.g. torch.zeros(1, 128, dtype=torch.long), "
            "or leave seq_len=None"
        )


def plan(
    model: ModelLike,
    batch: Any,
    memory: str | Sequence[Any] | None = None,
    *,
    mode: Mode = "dp",
    criterion: Callable[..., torch.Tensor] | None = None,
    optimizer: OptimizerFactory | None = torch.optim.AdamW,
    batch_size: int | None = None,
    amp: torch.dtype | str | None = None,
    checkpointing: bool | Callable[[nn.Module], bool] = False,
    gradient_as_bucket_view: bool = False,
    gather_output: bool = True,
    output_device: int = 0,
    safety_margin: float | None = None,
    cuda_context: int | str = DEFAULT_CONTEXT,
    no_grad: bool = False,
    seq_len: int | None = None,
    allocator: CudaAllocatorModel | str | None = "auto",
    calibrate: bool | Sequence[Measurer | None] | None = None,
) -> Plan:
    """Predict every device's memory for a training step and choose the per-device split.

    Args:
        model: an ``nn.Module`` (copied onto fake tensors) or a function returning one
            (called under ``FakeTensorMode``: build on CPU, it allocates nothing).
        batch: an example batch (tensors with the batch in dim 0; its size does not matter)
            or a function ``batch(n)``. Without ``criterion`` it is the model's input (a
            tensor, a tuple of positional arguments, or a dict of keyword arguments) and the
            loss is the model's first scalar output; with ``criterion`` it is
            ``(inputs, targets)`` and the loss is ``criterion(model(inputs), targets)``.
        memory: each device's memory: ``"24GiB,24GiB-10GiB,12GiB"`` (see
            :func:`evendp.parse_memory`), a list of sizes or ``DeviceMemory``, or ``None`` to
            read the live GPUs' free memory.
        mode: ``"dp"`` (one process; device 0 holds the optimizer, and the gathered outputs
            and loss on ``output_device``) or ``"ddp"`` (one process per device).
        optimizer: a factory ``optimizer(params)``; ``None`` for no optimizer state.
        batch_size: plan this global batch; ``None`` for the largest that fits.
        amp: ``torch.bfloat16`` or ``torch.float16`` to plan under autocast; the
            :class:`TrainConfig` spellings ``"bf16"``, ``"fp16"`` and ``"none"`` work too.
        checkpointing: ``True`` to checkpoint every block of every ``nn.ModuleList``, or a
            predicate choosing the modules to checkpoint.
        gradient_as_bucket_view: DDP's option; without it buckets cost one more gradient.
        gather_output: DP only; ``False`` when the loss is computed per device
            (``ParallelCriterion``), so no outputs are gathered (the same name as
            :class:`BalancedDataParallel`'s).
        safety_margin: each device may use ``free * (1 - safety_margin)``. ``None`` (the
            default): 0.05 where tensors are counted (CPU devices, ``allocator=None``); 0
            where the CUDA allocator is modelled, whose fitted fragmentation allowance is
            that margin (docs/planner.md, "The margin").
        cuda_context: bytes per device for the CUDA context (0: a CPU virtual device). The
            libraries' workspaces are the allocator model's (``allocator``).
        no_grad: plan a forward-only step (inference, evaluation, feature extraction under
            ``torch.no_grad``, model in eval mode): no gradients, no optimizer state, no
            activations saved for backward; ``optimizer`` and ``checkpointing`` are ignored.
            The training plan for the same devices is attached as ``Plan.training`` (``None``
            when not even one training sample fits), so both largest batches are reported.
        seq_len: plan per-device caps in padded tokens (``Plan.max_tokens``) for steps whose
            rows are padded to at most ``seq_len``: the example batch's sequence dimension
            (dim 1 of its 2-D and wider tensors) is set to ``seq_len``, and one more width
            (``seq_len // 2``) is measured to fit the token cost (``Plan.token_cost``).
        allocator: ``"auto"``: on CUDA devices (any ``cuda_context`` but 0) the peak is what
            PyTorch's caching allocator reserves, replayed step by step
            (:mod:`evendp._planning._allocator`) for the live GPU's architecture, or Hopper's
            for declared memory; on CPU virtual devices what the tensors hold. A
            ``CudaAllocatorModel`` chooses the architecture and setting; ``None``: tensors.
        calibrate: measure the real model on the devices (docs/planner.md, "Measured on the
            device"). ``None`` (the default): on live CUDA devices, real steps at two small
            sizes on each lower a device whose measured line fits fewer samples than
            planned, said in one line. ``False``: never; ``True``: the live CUDA devices or
            an error; a sequence: one :class:`evendp._planning._on_device.Measurer` (or
            ``None``) per device. Training plans only.

    The planner measures a few batch sizes and then the sizes it is about to recommend, and
    solves again on every new measurement. When a recommended size still lies beyond the
    largest measured one (the rounds ran out), ``Plan.extrapolated`` is ``True``: beyond the
    measured range the prediction is a lower bound for a convex peak, so check that plan.

    Raises :class:`PlanError` when the model fails on fake tensors or no batch fits.

    >>> net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    >>> p = plan(net, torch.randn(1, 256), "1GiB,1GiB,512MiB", mode="ddp",
    ...          cuda_context=0)
    >>> p.split == [d.samples for d in p.devices] and p.eta_mem >= 0.95
    True
    >>> inference = plan(net, torch.randn(1, 256), "1GiB,1GiB,512MiB", mode="ddp",
    ...                  cuda_context=0, no_grad=True)
    >>> inference.no_grad, inference.global_batch > inference.training.global_batch
    (True, True)
    """
    amp = amp_dtype(amp)
    mems = _validate_memory_specs(memory)
    k = len(mems)
    context = parse_bytes(cuda_context)
    replay = _validate_allocator(allocator, context, mems)
    if safety_margin is None:
        safety_margin = DEFAULT_MARGIN if replay is None else 0.0
    _validate_options(mode, safety_margin, output_device, k, batch_size)
    validate_bool("no_grad", no_grad)
    validate_bool("gather_output", gather_output)
    validate_bool("gradient_as_bucket_view", gradient_as_bucket_view)
    if not isinstance(checkpointing, bool):
        validate_callable("checkpointing", checkpointing, "True, False or a function module->bool")
    validate_int("seq_len", seq_len, minimum=2, allow_none=True, example="seq_len=1024")
    if seq_len is not None:
        _validate_sequence_batch(batch)
    common: dict[str, Any] = dict(
        mode=mode,
        criterion=criterion,
        amp=amp,
        gradient_as_bucket_view=gradient_as_bucket_view,
        gather=gather_output,
        output_device=output_device,
        safety_margin=safety_margin,
        context=context,
        seq_len=seq_len,
        allocator=replay,
    )
    # Plan what was asked whatever the caller's grad mode (weights="auto" plans on a first
    # call that may run under torch.inference_mode or torch.no_grad).
    with torch.inference_mode(False), torch.enable_grad():
        if not no_grad:
            result = _plan_step(
                model, batch, mems, optimizer=optimizer, batch_size=batch_size,
                checkpointing=checkpointing, no_grad=False, **common,
            )  # fmt: skip
            return _calibrated(result, calibrate, model, batch, mems, common, optimizer,
                               checkpointing)  # fmt: skip
        forward = _plan_step(
            model, batch, mems, optimizer=None, batch_size=batch_size,
            checkpointing=False, no_grad=True, **common,
        )  # fmt: skip
        try:  # the training step on the same devices, for comparison: its largest batch
            training: Plan | None = _plan_step(
                model, batch, mems, optimizer=optimizer, batch_size=None,
                checkpointing=checkpointing, no_grad=False, **common,
            )  # fmt: skip
        except PlanError:
            training = None  # inference fits where not even one training sample does
    return dataclasses.replace(forward, training=training)


def _calibrated(
    result: Plan,
    calibrate: bool | Sequence[Measurer | None] | None,
    model: ModelLike,
    batch: Any,
    mems: _Fleet,
    common: dict[str, Any],
    optimizer: OptimizerFactory | None,
    checkpointing: bool | Callable[[nn.Module], bool],
) -> Plan:
    """``result`` held to the devices' measured lines where :func:`measurers_for` measures
    (the one hook of the calibration for every planning surface)."""
    names = [mems.name(i) for i in range(len(mems))]
    step = cuda_step(
        model, validate_batch(at_width(batch, common["seq_len"]) if common["seq_len"] else batch),
        criterion=common["criterion"], optimizer=optimizer, amp=common["amp"],
        checkpointing=checkpointing,
    )  # fmt: skip
    # DP: only the output device holds the optimizer; DDP: every rank's device does.
    holder = common["output_device"] if common["mode"] == "dp" else None
    measurers = measurers_for(calibrate, names, step, holder)
    if measurers is None:
        return result
    _note("measuring the real model on the devices (two small sizes each)")
    # A CUDA error, another process's OOM: said, never guessed. An EvendpError, not a
    # PlanError: "auto" takes a PlanError for "nothing fits".
    with planning_errors("running the real model on the device", EvendpError):
        fixed, notes = calibrated_plan(result, measurers)
    del measurers, step  # the copies on the devices go before the run allocates
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # GPU only
        torch.cuda.empty_cache()
    for line in notes:  # each lowered device, one line on stderr
        print(line, file=sys.stderr, flush=True)
    remember(fixed)  # the Trainer's first-step check compares its first step with it
    return fixed


def _plan_step(
    model: ModelLike,
    batch: Any,
    mems: _Fleet,
    *,
    mode: Mode,
    criterion: Callable[..., torch.Tensor] | None,
    optimizer: OptimizerFactory | None,
    batch_size: int | None,
    amp: torch.dtype | None,
    checkpointing: bool | Callable[[nn.Module], bool],
    gradient_as_bucket_view: bool,
    gather: bool,
    output_device: int,
    safety_margin: float,
    context: int,
    no_grad: bool,
    seq_len: int | None = None,
    allocator: CudaAllocatorModel | None = None,
) -> Plan:
    """One plan (a training step, or a forward under ``no_grad``) on validated options."""
    start = time.perf_counter()
    if seq_len is not None:
        batch = at_width(batch, seq_len)
    setup = make_setup(model, batch, criterion, optimizer, amp, checkpointing, no_grad)
    setup.gpu = allocator is not None  # a GPU's kernels: see _measure._FusedAttention
    if mode == "ddp" or not gather:
        variant = "keep"
    else:
        variant = "handoff" if criterion is not None else "drop"
    budgets = [(int(free * (1.0 - safety_margin)), count) for count, free, _ in mems.runs]

    replica: dict[int, Point] = {}
    crit: dict[int, Point] = {}
    sample: Any = None  # a replica's fake outputs, for the criterion on the output device
    step = "a fake forward" if no_grad else "a fake step"

    def on_replica(n: int) -> None:
        _note(f"{step} of {n} samples on one device")
        point = measure_replica(setup, n, variant)
        replica[n] = point if allocator is None else with_allocator(point, allocator)

    def on_output_device(n: int) -> None:
        assert sample is not None  # needs_crit measured it first
        _note(f"the criterion on {n} gathered samples")
        crit[n] = measure_gathered(setup, sample, 2, n)

    with planning_errors("running the model on fake tensors"):
        for n in (2, 4):
            on_replica(n)
    needs_crit = mode == "dp" and gather and criterion is not None
    if needs_crit:
        with planning_errors("computing the criterion on fake gathered outputs"):
            sample = sample_output(setup, 2)
            for n in (2, 4):
                on_output_device(n)

    def solve(batch: int | None) -> tuple[MemoryModel, list[Segment]]:
        held = monotone_allocator(replica)
        static = {key: float(v) for key, v in held[min(held)].static.items()}
        mdl = MemoryModel(
            mode=mode,
            output_device=output_device,
            static=static,
            replica=Curve({n: p.fwbw for n, p in held.items()}),
            forward_end=Curve({n: p.forward_end for n, p in held.items()}),
            outputs=Curve({n: {"bytes": float(p.output_bytes)} for n, p in held.items()}),
            gathered=Curve({n: p.fwbw for n, p in crit.items()}) if needs_crit else None,
            gathered_held=Curve({n: p.forward_end for n, p in crit.items()})
            if needs_crit
            else None,
            buckets=0 if (mode == "dp" or gradient_as_bucket_view) else int(static["grads"]),
            context=context,
        )
        # Per distinct device (budget and role), not per device: see solve_spans.
        return mdl, solve_spans(mdl, cut_spans(mdl, budgets), batch)

    def beyond_measured(sol: list[Segment]) -> tuple[set[int], set[int]]:
        """Recommended sizes past the largest measured one: replica sizes, global batches."""
        sizes = {n for seg in sol for n in (seg.split, seg.alone, seg.even)}
        if seq_len is not None:  # token caps rest on them
            sizes |= {seg.cap for seg in sol}
        want_rep = {n for n in sizes if n > max(replica)}
        want_crit: set[int] = set()
        if needs_crit:
            alone_out = next(g.alone for g in sol if g.start <= output_device < g.start + g.count)
            totals = [_sum(sol, "split"), _sum(sol, "even"), alone_out]
            want_crit = {t for t in totals if t > max(crit)}
        return want_rep, want_crit

    def refine(batch: int | None) -> tuple[MemoryModel, list[Segment]]:
        mdl, sol = solve(batch)
        for _ in range(_MAX_ROUNDS):
            want_rep, want_crit = beyond_measured(sol)
            if not want_rep and not want_crit:
                break
            with planning_errors("running the model on fake tensors"):
                # The largest only: every chord below it interpolates, an upper bound there.
                for n in sorted(want_rep)[-1:]:
                    on_replica(n)
                for n in sorted(want_crit)[-1:]:
                    on_output_device(n)
            mdl, sol = solve(batch)  # the answer always rests on the last measurement
        return mdl, sol

    if batch_size is not None and allocator is not None:
        try:
            solve(batch_size)
        except PlanError:
            # The allocator's bytes step with its segments, so the chord through the first
            # small sizes is no guide far beyond them: a batch that does not fit there is
            # judged on measurements at the largest that fits, as a plan without it is.
            refine(None)
    mdl, sol = refine(batch_size)
    options = {
        "criterion": criterion is not None,
        "optimizer": getattr(optimizer, "__name__", repr(optimizer)),
        "amp": None if amp is None else str(amp).removeprefix("torch."),
        "checkpointing": bool(checkpointing),
        "gradient_as_bucket_view": gradient_as_bucket_view,
        "gather": gather,
        "output_device": output_device,
        "cuda_context": context,
        "allocator": None,
    }
    if allocator is not None:
        setting = "expandable" if allocator.config.expandable_segments else "segments"
        options["allocator"] = f"cuda sm{allocator.major}x, {setting}"
    extrapolated = any(beyond_measured(sol))
    result = _to_plan(mdl, mems, sol, replica, safety_margin, start, extrapolated, options, no_grad)
    if seq_len is None:
        return result
    short = make_setup(
        model, at_width(batch, seq_len // 2), criterion, optimizer, amp, checkpointing, no_grad
    )
    short.gpu = setup.gpu
    with planning_errors("running the model on fake tensors at a shorter width"):
        _note(f"{step} of 4 samples at width {seq_len // 2}")
        shorter = measure_replica(short, 4, variant)
        shorter = shorter if allocator is None else with_allocator(shorter, allocator)
    return _with_token_caps(result, sol, seq_len, replica, shorter)


def _validate_allocator(allocator: Any, context: int, mems: _Fleet) -> CudaAllocatorModel | None:
    """``plan(allocator=)``: ``"auto"``, ``None`` or a :class:`CudaAllocatorModel`."""
    if allocator is None or isinstance(allocator, CudaAllocatorModel):
        return allocator
    if allocator != "auto":
        raise EvendpError(
            f"allocator must be 'auto', None or a CudaAllocatorModel, got {allocator!r}; "
            "e.g. allocator='auto'"
        )
    names = mems.names or []
    if context == 0 and not any(n.startswith("cuda") for n in names):
        return None  # CPU virtual devices: their budget counts what tensors hold
    cuda = [int(n.split(":")[1]) for n in names if n.startswith("cuda:")]
    if cuda and torch.cuda.is_available():  # --- GPU-only: the live device's architecture ---
        return CudaAllocatorModel.live(cuda[0])
    return CudaAllocatorModel()  # declared (or stood-in) GPUs: Hopper's, the largest workspaces


def _sum(segments: list[Segment], name: str) -> int:
    return sum(getattr(seg, name) * seg.count for seg in segments)


def _with_token_caps(
    result: Plan, sol: list[Segment], seq_len: int, replica: dict[int, Point], shorter: Point
) -> Plan:
    """``result`` with each device's cap in padded tokens and the fitted token cost.

    The cap is the device's most samples at width ``seq_len`` (in the planned global batch)
    times ``seq_len``. A share padded to a width ``w <= seq_len`` costs ``fixed + tokens *
    (per_token + per_token_width * w)``, so the same tokens cost no more at a shorter width
    (``per_token_width >= 0``): the cap holds for every step whose rows are at most
    ``seq_len`` long.
    """
    points = {(n, seq_len): sum(replica[n].fwbw.values()) for n in sorted(replica)[:2]}
    points[(shorter.n, seq_len // 2)] = sum(shorter.fwbw.values())
    fixed, per_token, per_token_width = token_fit(points)
    tokens = [c * seq_len for c in expand(sol, "cap")]
    rows = result.devices  # _to_plan makes one run per segment
    devices = DeviceRows(
        [(start, count, dataclasses.replace(proto, max_tokens=seg.cap * seq_len))
         for (start, count, proto), seg in zip(rows.runs, sol, strict=True)],
        rows._name,
    )  # fmt: skip
    cost = {"fixed": fixed, "per_token": per_token, "per_token_width": per_token_width}
    return dataclasses.replace(
        result, devices=devices, max_tokens=tokens, seq_len=seq_len, token_cost=cost
    )


def _to_plan(
    mdl: MemoryModel,
    mems: _Fleet,
    sol: list[Segment],
    replica: dict[int, Point],
    margin: float,
    start: float,
    extrapolated: bool,
    options: dict[str, Any],
    no_grad: bool,
) -> Plan:
    total, even_total = _sum(sol, "split"), _sum(sol, "even")
    runs = []
    ends = list(itertools.accumulate(count for count, _, _ in mems.runs))
    for seg in sol:  # one DevicePlan per run of alike devices: DeviceRows names each
        i = seg.start
        ours = {k: round(v) for k, v in mdl.breakdown(i, seg.split, total).items() if v}
        even = {k: round(v) for k, v in mdl.breakdown(i, seg.even, even_total).items() if v}
        proto = DevicePlan(
            name="",
            free=mems.runs[bisect.bisect_right(ends, i)][1],
            budget=seg.budget,
            samples=seg.split,
            breakdown=ours,
            peak=sum(ours.values()),
            max_batch_alone=seg.alone,
            even_samples=seg.even,
            even_breakdown=even,
            even_peak=sum(even.values()),
        )
        runs.append((seg.start, seg.count, proto))
    devices = DeviceRows(runs, mems.name)
    reach = max(1, _sum(sol, "alone"))
    return Plan(
        mode=mdl.mode,
        devices=devices,
        split=expand(sol, "split"),
        global_batch=total,
        eta_mem=total / reach,
        even_split=expand(sol, "even"),
        even_global_batch=even_total,
        even_eta_mem=even_total / reach if all(p.even_fits for _, _, p in runs) else 0.0,
        activation_bytes_per_sample=mdl.forward_end.slope(),  # the parameters cancel out
        output_bytes_per_sample=mdl.outputs.slope(),
        measured_sizes=sorted(replica),
        safety_margin=margin,
        seconds=time.perf_counter() - start,
        extrapolated=extrapolated,
        options=options,
        no_grad=no_grad,
    )


def _gathered_loss(output: Any, targets: Any) -> torch.Tensor:
    """Stand-in for the loss a caller computes on ``BalancedDataParallel``'s gathered output:
    a loss the model computed arrives as one entry per device (at most one dimension) and
    only it is backpropagated; else every floating output gets a full-size gradient."""
    floats = [t for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    losses = [t for t in floats if t.dim() <= 1]
    used = losses or floats
    return sum((t.float().mean() for t in used), torch.zeros(()))


def auto_weights(
    module: nn.Module,
    device_ids: Sequence[torch.device | int | str],
    example_inputs: Any,
    *,
    output_device: int = 0,
    optimizer: OptimizerFactory | None = torch.optim.AdamW,
    safety_margin: float = 0.1,
    gather_output: bool = True,
    criterion: Callable[..., torch.Tensor] | None = None,
    no_grad: bool = False,
    memory: Sequence[DeviceMemory] | None = None,
) -> list[float]:
    """Per-device weights for ``BalancedDataParallel(weights="auto")``: the largest DP split
    that fits the devices' free memory right now (NVML, or ``torch.cuda.mem_get_info``), the
    module's tensors already there counted as free for it; 1.0 each on CPU devices.

    It plans the program that will run: with ``gather_output=True`` the outputs gathered on
    ``output_device`` and their gradient (through ``criterion(outputs, None)``, else
    :func:`_gathered_loss`); with ``no_grad=True`` (the first call ran without grad) a forward
    only. ``safety_margin`` is 0.1: live free memory is what other processes left a moment
    ago, and they keep allocating. ``memory`` (one :class:`DeviceMemory` per device, e.g.
    ``EVENDP_MEMORY``'s) replaces the live read and keeps room for a CUDA context on GPUs.

    >>> auto_weights(nn.Linear(4, 2), ["cpu", "cpu", "cpu"], torch.randn(5, 4))
    [1.0, 1.0, 1.0]
    """
    devices = [
        torch.device(d) if not isinstance(d, int) else torch.device("cuda", d) for d in device_ids
    ]
    if not devices:
        raise EvendpError("device_ids is empty; pass the devices BalancedDataParallel uses")
    cuda = all(d.type == "cuda" for d in devices)
    context = DEFAULT_CONTEXT if cuda else 0  # declared memory: the context is not yet taken
    if memory is not None:
        mems = list(memory)
    elif not cuda:
        return [1.0] * len(devices)
    else:  # --- GPU-only path (tests reach it with a fake live_memory) ---
        mems, context = _live_free_memory(module, devices), 0  # the live read is after it
    if no_grad:
        # Forward only: DP gathers the outputs on output_device and nothing flows back. No
        # training plan beside it (plan(no_grad=True) adds one): only the split is used.
        _validate_options("dp", safety_margin, output_device, len(mems), None)
        with torch.inference_mode(False), torch.enable_grad():
            forward = _plan_step(
                module, example_inputs, _Fleet.of(mems), mode="dp", criterion=None, optimizer=None,
                batch_size=None, amp=None, checkpointing=False, gradient_as_bucket_view=False,
                gather=gather_output, output_device=output_device, safety_margin=safety_margin,
                context=context, no_grad=True,
            )  # fmt: skip
        return [float(n) for n in forward.split]
    batch: Any
    if gather_output:
        # The planner's criterion form: batch = (inputs, targets); the caller's targets are
        # not known here, and the gathered outputs and their gradient dominate anyway.
        batch = (example_inputs, None)
        loss = criterion if criterion is not None else _gathered_loss
    else:
        batch, loss = example_inputs, None
    result = plan(
        module,
        batch,
        mems,
        mode="dp",
        criterion=loss,
        optimizer=optimizer,
        gather_output=gather_output,
        output_device=output_device,
        safety_margin=safety_margin,
        cuda_context=context,
    )
    return [float(n) for n in result.split]


def _live_free_memory(module: nn.Module, devices: list[torch.device]) -> list[DeviceMemory]:
    """Each CUDA device's live free memory, plus the module's own tensors already there;
    repeated (virtual) devices share one GPU's memory."""
    indices = [d.index if d.index is not None else torch.cuda.current_device() for d in devices]
    live = {m.name: m for m in live_memory(sorted(set(indices)))}
    resident: Counter[int] = Counter()
    for t in [*module.parameters(), *module.buffers()]:
        if t.device.type == "cuda":
            resident[t.device.index] += t.numel() * t.element_size()
    return [
        DeviceMemory(f"cuda:{i}", (live[f"cuda:{i}"].free + resident[i]) // indices.count(i))
        for i in indices
    ]
