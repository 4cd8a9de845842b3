"""A plan made on live CUDA devices, fixed by a short calibration of the real model there.

:func:`evendp.plan` is the one place every planning surface passes through (``evendp plan``,
``weights="auto"``, ``batch_sizes="auto"``, ``evendp train``, ``UnevenTrainer`` and
``uneven_dataloader``'s ``"auto"``), so the calibration is hooked there once:
:func:`measurers_for` decides whether to calibrate (``calibrate=None``: when every device is
a live CUDA device, ``cuda:N`` on a machine with CUDA), and :func:`calibrated_plan` runs the
:class:`~._calibrate.Measurer` of each device at two small sizes and holds the plan to the
measured line (:func:`~._calibrate.calibrated_split`: a share is only ever lowered, each
lowered device said in one line on stderr). On CPU devices nothing changes.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .._core._errors import EvendpError
from ._calibrate import (
    Calibration,
    CudaMeasurer,
    Measurer,
    calibrate,
    calibrated_split,
    calibration_sizes,
)
from ._result import DeviceRows, Plan

__all__ = [
    "calibrated_plan",
    "cuda_step",
    "forget",
    "live_cuda",
    "measurer",
    "measurers_for",
    "planned_for",
    "remember",
]

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
    """Each device's :class:`Measurer` for ``plan(calibrate=...)``, or ``None`` (no calibration).

    ``None``: calibrate when every device is a live CUDA device (``cuda:N`` and CUDA
    available), as read by ``memory=None`` or :func:`evendp.live_memory`; declared memory
    (``"24GiB"``: ``dev0``...) is planned ahead of a run and not measured. ``True``: calibrate
    the CUDA devices (an error elsewhere). ``False``: never. A sequence: one measurer (or
    ``None``) per device, e.g. a test's fake.

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
