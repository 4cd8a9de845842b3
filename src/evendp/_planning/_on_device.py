"""Measuring the real model on a live device: the plan's line, the CUDA context, the first step.

The planner predicts a device's peak from a step run on fake tensors
(:mod:`._measure`) and a model of the caching allocator (:mod:`._allocator`). Where the
devices are live, two measurements replace assumptions:

- **Calibration**: real steps of the real model at two small batch sizes, the allocator's
  peak reserved bytes after each (``torch.cuda.reset_peak_memory_stats`` before,
  ``torch.cuda.max_memory_reserved`` after), fix the line ``bytes = fixed + per_sample * n``
  (:func:`calibrate`). A convex peak lies above its chord only between the two sizes, so
  the plan keeps the larger of this line and the model's prediction (:meth:`Line.cap`).
  It is hooked once, in :func:`evendp.plan`, which every planning surface passes through:
  :func:`measurers_for` decides whether to calibrate (``calibrate=None``: when every device
  is a live CUDA device) and :func:`calibrated_plan` lowers a share to the measured line,
  each lowered device said in one line on stderr. On CPU devices nothing changes.
- **The CUDA context** is read, not assumed: what the device uses beyond the allocator's
  reservation (``torch.cuda.mem_get_info``: total - free - ``memory_reserved``), which is the
  context, the libraries' own memory and anything else in the process outside the allocator.
- **The first real step is checked** against the plan (:class:`FirstStepCheck`): a device
  whose reserved peak passed its plan is said in one line and its micro-batch lowered so
  the next step fits in its budget, before it runs out. The micro-batch is a per-device
  cap inside the exact re-split (:class:`evendp._training._oom.OomResplit`): the shares
  and the gradient stay the same. The Trainer applies it in one process only: among ranks a
  cap lowered on one rank alone would change its micro-step count alone. The OOM re-split
  stays the net below.

Everything that touches a GPU is in :class:`CudaMeasurer` and :func:`cuda_step` (marked
GPU-only); the logic runs on any :class:`Measurer`, so tests inject fake measurements,
including ones that fail.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .._core._errors import EvendpError
from .._core._units import format_bytes
from ._result import DeviceRows, Plan

__all__ = [
    "Calibration",
    "CudaMeasurer",
    "FirstStepCheck",
    "Line",
    "Measurer",
    "calibrate",
    "calibrated_plan",
    "calibrated_split",
    "calibration_sizes",
    "cuda_step",
    "forget",
    "live_cuda",
    "measurer",
    "measurers_for",
    "planned_for",
    "remember",
]


class Measurer(Protocol):
    """What calibration needs from a device.

    ``reserved_after(n)``: run real training steps of ``n`` samples and return the
    allocator's peak reserved bytes over them (from a reset before them).
    ``context_bytes()``: the bytes the device uses outside the allocator (the CUDA context
    and libraries), read now.
    """

    def reserved_after(self, n: int) -> int: ...

    def context_bytes(self) -> int: ...


@dataclass(frozen=True)
class Line:
    """Peak bytes as ``fixed + per_sample * n``, measured at ``sizes``.

    >>> line = Line(fixed=1000, per_sample=100.0, sizes=(2, 4))
    >>> line.at(10), line.cap(2000), line.cap(900)
    (2000, 10, 0)
    """

    fixed: int
    per_sample: float
    sizes: tuple[int, int]

    def at(self, n: int) -> int:
        return math.ceil(self.fixed + self.per_sample * n)

    def cap(self, budget: int) -> int:
        """The most samples whose line stays within ``budget`` bytes (0 when none fit)."""
        if self.fixed > budget:
            return 0
        if self.per_sample <= 0:
            raise EvendpError(
                "the calibration measured no memory per sample; calibrate at sizes further "
                "apart (e.g. 2 and 8)"
            )
        return int((budget - self.fixed) // self.per_sample)


@dataclass(frozen=True)
class Calibration:
    """One device's measurements: its line and its CUDA context bytes."""

    line: Line
    context: int


def calibration_sizes(planned: int) -> tuple[int, int]:
    """Two small sizes to measure a device planned for ``planned`` samples: an eighth and a
    quarter of it (at least 1 and 2), far enough apart that the allocator's 2 MiB and 20 MiB
    steps do not swamp the slope, small enough to run in seconds and never out of memory.

    >>> calibration_sizes(64), calibration_sizes(3)
    ((8, 16), (1, 2))
    """
    low = max(1, planned // 8)
    return low, max(low + 1, planned // 4)


def calibrate(measurer: Measurer, sizes: Sequence[int]) -> Calibration:
    """Measure ``measurer``'s device at two sizes and fit the line through the two peaks.

    A measurement that fails (the device ran out, or the driver failed) raises
    :class:`EvendpError` naming the size: calibration must not guess.

    >>> class Fake:
    ...     def reserved_after(self, n): return 300 + 50 * n
    ...     def context_bytes(self): return 7
    >>> c = calibrate(Fake(), (2, 6))
    >>> c.line.fixed, c.line.per_sample, c.context
    (300, 50.0, 7)
    """
    if len(sizes) != 2 or not all(isinstance(n, int) and n >= 1 for n in sizes):
        raise EvendpError(f"calibration needs two batch sizes >= 1, got {list(sizes)!r}")
    # Imported here, not with evendp: `python -m` runs that module, and runpy warns on one
    # imported before it runs.
    from .._distributed._first_step import evendp_steps

    a, b = sorted(sizes)
    if a == b:
        raise EvendpError(f"calibration needs two different batch sizes, got {list(sizes)!r}")
    peaks = []
    for n in (a, b):
        try:  # real optimizer steps, not a launched script's first (its hook waits)
            with evendp_steps():
                peaks.append(int(measurer.reserved_after(n)))
        except Exception as exc:  # the device's own failure, named with the size
            raise EvendpError(
                f"calibrating at {n} samples failed: {type(exc).__name__}: {exc}"
            ) from exc
    if peaks[1] < peaks[0]:
        raise EvendpError(
            f"calibration measured less memory at {b} samples ({peaks[1]} bytes) than at {a} "
            f"({peaks[0]} bytes); another process is using the device, or the step is not the "
            "training step to plan"
        )
    slope = (peaks[1] - peaks[0]) / (b - a)
    return Calibration(
        Line(int(peaks[0] - slope * a), slope, (a, b)), int(measurer.context_bytes())
    )


def calibrated_split(
    split: Sequence[int], free: Sequence[int], calibrations: Sequence[Calibration | None]
) -> tuple[list[int], list[str]]:
    """A plan's ``split`` held to each device's measured line: device ``i`` takes at most
    ``line.cap(free[i] - context)`` samples (``free``: its free bytes read before this
    process's CUDA context existed; ``None``: not calibrated, kept). The plan keeps the
    larger of its model and the line, so a share is only ever lowered; each lowered device
    is said in one line.

    >>> line = Line(fixed=1000, per_sample=100.0, sizes=(2, 4))
    >>> calibrated_split([12, 12], [2500, 2500], [Calibration(line, 500), None])
    ([10, 12], ['evendp: device 0 measured 1000 B + 100 B per sample: 10 samples fit, not 12'])
    """
    out, notes = [], []
    for i, (n, cal) in enumerate(zip(split, calibrations, strict=True)):
        if cal is None:
            out.append(int(n))
            continue
        cap = cal.line.cap(int(free[i]) - cal.context)
        if cap < n:
            notes.append(
                f"evendp: device {i} measured {format_bytes(cal.line.fixed)} + "
                f"{format_bytes(cal.line.per_sample)} per sample: {cap} samples fit, not {n}"
            )
        out.append(min(int(n), cap))
    return out, notes


class FirstStepCheck:
    """The first real step against the plan, per device: over its planned peak, its
    micro-batch is lowered so the next step stays within its budget.

    ``planned``: each device's planned peak (bytes, the allocator's reserved figure);
    ``budgets``: what each may use. :meth:`check` takes the measured reserved peaks (``None``
    for a device that measures none, a CPU) and the samples each ran, and returns each
    device's new micro-batch cap (``None``: unchanged), with :attr:`notes` saying why.

    >>> check = FirstStepCheck(planned=[1000, 1000], budgets=[1100, 1100])
    >>> check.check(measured=[900, 1300], samples=[8, 8])
    [None, 6]
    >>> check.notes[0]
    'evendp: device 1 reserved 1.3 KiB at its first step, over its plan of 1000 B: ...'
    """

    def __init__(self, planned: Sequence[int], budgets: Sequence[int]) -> None:
        if len(planned) != len(budgets):
            raise EvendpError(
                f"FirstStepCheck needs one budget per planned device, got {len(planned)} "
                f"planned and {len(budgets)} budgets"
            )
        self.planned = [int(p) for p in planned]
        self.budgets = [int(b) for b in budgets]
        self.notes: list[str] = []

    def check(self, measured: Sequence[int | None], samples: Sequence[int]) -> list[int | None]:
        caps: list[int | None] = []
        for i, (peak, n) in enumerate(zip(measured, samples, strict=True)):
            if peak is None or n <= 0 or peak <= self.planned[i]:
                caps.append(None)
                continue
            # The bytes beyond the plan's taken to grow with the samples at once: the share
            # scaled by budget / measured (at least 1).
            cap = max(1, min(n - 1, math.floor(n * self.budgets[i] / peak)))
            caps.append(cap)
            self.notes.append(
                f"evendp: device {i} reserved {format_bytes(peak)} at its first step, over its "
                f"plan of {format_bytes(self.planned[i])}: micro-batches of at most {cap} of "
                f"its {n} samples from now on (the split and the gradient are unchanged)"
            )
        return caps

    def apply(self, caps: Sequence[int | None], micro_batch_sizes: list[int | None]) -> None:
        """Lower ``micro_batch_sizes`` (an :class:`OomResplit`'s, per device) to ``caps``."""
        for i, cap in enumerate(caps):
            if cap is not None:
                old = micro_batch_sizes[i]
                micro_batch_sizes[i] = cap if old is None else min(old, cap)


class CudaMeasurer:  # pragma: no cover - GPU-only: tests use fake Measurers
    """:class:`Measurer` for one CUDA device: ``step(n)`` runs one real training step of
    ``n`` samples on it (forward, backward, optimizer step, gradients set to None).

    --- GPU-only: everything below touches CUDA. ---
    """

    def __init__(self, device: int, step: Callable[[int], None], steps: int = 2) -> None:
        self.device = device
        self.step = step
        self.steps = steps

    def reserved_after(self, n: int) -> int:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the last size's cached blocks must not count for this one
        torch.cuda.reset_peak_memory_stats(self.device)
        for _ in range(self.steps):  # the first makes optimizer state and workspaces
            self.step(n)
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_reserved(self.device))

    def context_bytes(self) -> int:
        """This process's bytes on the device outside the allocator: NVML's count for this
        process (other processes on a shared GPU excluded) minus what the allocator has
        reserved; without NVML, the device's used bytes minus it (a GPU of its own)."""
        import os

        reserved = torch.cuda.memory_reserved(self.device)
        try:
            from ._devices import load_nvml

            nvml = load_nvml()
            nvml.nvmlInit()
            props = torch.cuda.get_device_properties(self.device)
            domain, bus, dev = (getattr(props, f"pci_{k}_id") for k in ("domain", "bus", "device"))
            handle = nvml.nvmlDeviceGetHandleByPciBusId(f"{domain:08X}:{bus:02X}:{dev:02X}.0")
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if proc.pid == os.getpid() and proc.usedGpuMemory:
                    return int(proc.usedGpuMemory - reserved)
        except Exception:  # NVML missing or unable: the device-wide reading below
            pass
        free, total = torch.cuda.mem_get_info(self.device)
        return int(total - free - reserved)


#: What builds one device's real step: ``(device, with_optimizer)`` -> ``step(n)``.
StepFactory = Callable[[torch.device, bool], Callable[[int], None]]


def _cuda_index(name: str) -> int | None:
    head, _, index = name.partition(":")
    return int(index) if head == "cuda" and index.isdigit() else None


def measurers_for(
    calibrate: bool | Sequence[Measurer | None] | None,
    names: Sequence[str],
    make_step: StepFactory,
    output_device: int | None,
) -> list[Measurer | None] | None:
    """Each device's :class:`Measurer` for ``plan(calibrate=...)`` (see :func:`evendp.plan`),
    or ``None``: no calibration. Declared memory (``dev0``...) is planned ahead of a run and
    never measured.

    >>> measurers_for(None, ["dev0", "dev1"], lambda d, o: print, None) is None
    True
    """
    if calibrate is False:
        return None
    if calibrate is not None and calibrate is not True:
        if isinstance(calibrate, (str, bytes)) or not isinstance(calibrate, Sequence):
            raise EvendpError(
                f"calibrate must be None, True, False or one Measurer per device, got "
                f"{calibrate!r}; e.g. calibrate=False to plan without measuring"
            )
        if len(calibrate) != len(names):
            raise EvendpError(
                f"calibrate has {len(calibrate)} measurers for {len(names)} devices; give one "
                "per device (None for a device not to measure)"
            )
        return list(calibrate)
    indices = live_cuda(names)
    if indices is None:
        if calibrate is True:
            raise EvendpError(
                f"calibrate=True measures live CUDA devices, but the devices are {list(names)}; "
                "plan with memory=None on a GPU machine, or leave calibrate=None"
            )
        return None
    return [
        measurer(i, _lazy(make_step, torch.device("cuda", i), output_device in (None, k)))
        for k, i in enumerate(indices)
    ]


def _lazy(make_step: StepFactory, device: torch.device, optimizer: bool) -> Callable[[int], None]:
    """``make_step(device, optimizer)``, built at its first step: the model's copy goes on
    the device only when a measurement runs."""
    built: list[Callable[[int], None]] = []

    def step(n: int) -> None:
        if not built:
            built.append(make_step(device, optimizer))
        built[0](n)

    return step


def live_cuda(names: Sequence[str]) -> list[int] | None:
    """The CUDA indices of ``names`` when every one is a live CUDA device, else ``None``.

    >>> live_cuda(["dev0"]) is None
    True
    """
    indices = [_cuda_index(n) for n in names]
    if not names or None in indices or not torch.cuda.is_available():
        return None
    return [i for i in indices if i is not None]


def measurer(index: int, step: Callable[[int], None]) -> Measurer:
    """The :class:`Measurer` of CUDA device ``index`` (tests replace this attribute).

    --- GPU only when measured: :class:`CudaMeasurer` runs ``step`` on the device. ---
    """
    return CudaMeasurer(index, step)


def calibrated_plan(result: Plan, measurers: Sequence[Measurer | None]) -> tuple[Plan, list[str]]:
    """``result`` held to each device's measured line, and a line per lowered device.

    Device ``i`` is measured at :func:`calibration_sizes` of the most samples it holds alone
    (seconds, far from its budget); its share and that most are lowered to what the line
    fits in its budget less the measured CUDA context. A measurement that fails raises
    :class:`EvendpError` naming the device: a plan on live devices must not guess.

    >>> from evendp import plan
    >>> class Fake:  # 1 MiB fixed and 1 MiB per sample, as if measured on a GPU
    ...     def reserved_after(self, n): return (1 + n) << 20
    ...     def context_bytes(self): return 0
    >>> net = nn.Linear(8, 8)
    >>> p = plan(net, torch.randn(1, 8), "64MiB", mode="ddp", cuda_context=0)
    >>> fixed, notes = calibrated_plan(p, [Fake()])
    >>> fixed.devices[0].max_batch_alone, fixed.split == [d.samples for d in fixed.devices]
    (59, True)
    """
    devices = list(result.devices)
    cals: list[Calibration | None] = []
    for i, (d, m) in enumerate(zip(devices, measurers, strict=True)):
        if m is None or d.max_batch_alone < 1:
            cals.append(None)
            continue
        try:
            cals.append(calibrate(m, calibration_sizes(d.max_batch_alone)))
        except EvendpError as exc:
            raise EvendpError(
                f"calibrating device {i} ({d.name}) on the real model failed: {exc}; free the "
                "device, or plan without measuring: declared memory (--memory, "
                "EVENDP_MEMORY, memory=) or plan(calibrate=False)"
            ) from None
    budgets = [d.budget for d in devices]
    split, notes = calibrated_split(result.split, budgets, cals)
    alone, alone_notes = calibrated_split([d.max_batch_alone for d in devices], budgets, cals)
    if split == list(result.split) and alone == [d.max_batch_alone for d in devices]:
        return result, []
    tokens = result.max_tokens
    if tokens is not None and result.seq_len is not None:  # the token caps rest on the samples
        tokens = [min(t, n * result.seq_len) for t, n in zip(tokens, alone, strict=True)]
    lowered = [
        dataclasses.replace(d, name="", samples=split[i], max_batch_alone=alone[i],
                            max_tokens=d.max_tokens if tokens is None else tokens[i])
        for i, d in enumerate(devices)
    ]  # fmt: skip
    rows = DeviceRows([(i, 1, d) for i, d in enumerate(lowered)], lambda i: devices[i].name)
    total = sum(split)
    fixed = dataclasses.replace(
        result, devices=rows, split=split, global_batch=total, eta_mem=total / max(1, sum(alone)),
        max_tokens=tokens,
    )  # fmt: skip
    return fixed, notes or alone_notes


#: Per live CUDA device (``"cuda:N"``), the last calibrated plan's (peak, budget) in bytes:
#: what the Trainer's first-step check compares the device's first step with.
_PLANNED: dict[str, tuple[int, int]] = {}


def remember(result: Plan) -> None:
    """Record ``result``'s per-device planned peak and budget (a plan on live CUDA devices)."""
    for d in result.devices:
        if _cuda_index(d.name) is not None:  # what the Trainer's CUDA devices look up
            _PLANNED[d.name] = (d.peak, d.budget)


def forget() -> None:
    """Drop the recorded plans (a Trainer starts from its own: an earlier ``plan`` in the
    same process, of another model, is not its)."""
    _PLANNED.clear()


def planned_for(name: str) -> tuple[int, int] | None:
    """The (planned peak, budget) of live CUDA device ``name`` from this process's last
    calibrated plan, or ``None`` when none planned it.

    >>> planned_for("dev0") is None
    True
    """
    return _PLANNED.get(name)


def cuda_step(
    model: nn.Module | Callable[[], nn.Module],
    make_batch: Callable[[int], Any],
    *,
    criterion: Callable[..., torch.Tensor] | None,
    optimizer: Callable[[Any], torch.optim.Optimizer] | None,
    amp: torch.dtype | None,
    checkpointing: bool | Callable[[nn.Module], bool],
) -> StepFactory:  # pragma: no cover - GPU only: the steps run on a CUDA device
    """A :data:`StepFactory` for the real model: a copy of it on the device (the user's
    module is never moved or stepped), its optimizer when ``with_optimizer`` (DP replicas
    hold none), and ``step(n)``: forward, backward, optimizer step on ``n`` samples.

    --- GPU-only. A model already on the GPU is copied there beside itself, so its
    parameters count twice in the measured line: the calibration errs low, never high. ---
    """
    from ._measure import apply_checkpointing, call, loss_of

    def factory(device: torch.device, with_optimizer: bool) -> Callable[[int], None]:
        built = model() if not isinstance(model, nn.Module) else copy.deepcopy(model)
        on_meta = any(t.is_meta for t in [*built.parameters(), *built.buffers()])
        net = built.to_empty(device=device) if on_meta else built.to(device)
        net.train()
        apply_checkpointing(net, checkpointing)
        opt = optimizer(net.parameters()) if with_optimizer and optimizer is not None else None

        def to_device(t: Any) -> Any:
            return t.to(device) if isinstance(t, torch.Tensor) else t

        def step(n: int) -> None:
            batch = tree_map(to_device, make_batch(n))
            inputs, targets = batch if criterion is not None else (batch, None)
            with torch.autocast("cuda", dtype=amp or torch.float32, enabled=amp is not None):
                out = call(net, inputs)
                if criterion is not None and targets is not None:
                    loss = criterion(out, targets)
                else:
                    loss = loss_of(out)
            loss.backward()
            del out, loss
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=True)
            else:
                net.zero_grad(set_to_none=True)

        return step

    return factory
