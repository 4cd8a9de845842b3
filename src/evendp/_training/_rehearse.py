"""Rehearse a run on CPU virtual devices that enforce stated memory budgets
(:mod:`evendp._training._budget`): what ``evendp train`` with no arguments shows on the
built-in GPT, for any model (:func:`rehearse`).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch

from .._core._amp import amp_dtype
from .._core._calls import as_args
from .._core._errors import EvendpError, PlanError
from .._core._oom_errors import is_oom_error
from .._core._split import split_even
from .._core._validate import shown as shown_value
from .._core._validate import validate_callable, validate_float
from .._parallel._scatter import map_tensors, row_count
from .._planning._memory import parse_memory
from ._budget import MemoryBudgets, tensor_bytes
from ._report import TrainReport, format_bytes, write_report

__all__ = ["attach_budgets", "probe_even_split", "rehearse"]

#: Per device, an even split's ``(share, measured forward peak, ran out of its budget)``.
EvenShare = tuple[int, int | None, bool]


def attach_budgets(trainer: Any, memory: Sequence[int]) -> MemoryBudgets:
    """Make ``trainer``'s virtual devices enforce ``memory`` (bytes each); resident bytes are
    read live at every forward: each device's parameters, and on the first device also the
    gradients and the optimizer state (so their appearance after step one counts)."""
    params = tensor_bytes(list(trainer.model.parameters()))

    def resident(i: int) -> int:
        if i:  # a replica: its copy of the parameters
            return params
        grads = [p.grad for p in trainer.model.parameters()]
        return params + tensor_bytes(grads) + tensor_bytes(list(trainer.optimizer.state.values()))

    budgets = MemoryBudgets(list(memory), resident, names=trainer.device_names)
    trainer.memory_budgets = budgets.attach(trainer.wrapped)
    return budgets


def probe_even_split(
    trainer: Any, budgets: MemoryBudgets, batch: Any
) -> tuple[list[EvenShare], str]:
    """One forward of ``batch`` split evenly, as ``nn.DataParallel`` would, in the precision
    that trains: per device ``(even share, measured forward peak, ran out)`` and one line on
    the outcome. The budgets' peaks are reset before and after: the probe is not training's."""
    dp = trainer.wrapped
    even = split_even(int(row_count(batch) or 0), len(dp.device_ids))
    batch = map_tensors(batch, lambda t: t.to(dp.device_ids[0]))
    budgets.reset_peaks()
    failed: int | None = None
    dtype = amp_dtype(trainer.config.amp)
    kind = torch.device(trainer.device).type  # the replicas' threads inherit the autocast state
    precision = contextlib.nullcontext() if dtype is None else torch.autocast(kind, dtype=dtype)
    try:
        with precision, dp.fixed_sizes(even):
            dp(*as_args(batch))
    except (RuntimeError, ValueError) as exc:
        if not is_oom_error(exc):
            raise
        failed = getattr(exc, "evendp_device_index", None)
        first = str(exc).splitlines()[0]
        line = f"the even split {even} (what nn.DataParallel runs) fails: {first}"
    else:
        line = f"the even split {even} fits these budgets too"
    out = [(n, budgets.peaks[i], i == failed) for i, n in enumerate(even)]
    budgets.reset_peaks()
    return out, line


def plan_for(
    trainer: Any,
    memory: Sequence[int],
    batch: int,
    *,
    first: Any,
    say: Callable[[str], None] | None = None,
) -> Any:
    """The planner's :class:`~evendp.Plan` of ``batch`` samples of ``trainer``'s data and loss
    over ``memory`` (bytes per device; no CUDA context). Each measured batch has the shapes of
    ``first`` (the first batch training runs) grown to the rows measured,
    so a measurement reads no sample. ``say`` gets a line before each fake step measured.
    """
    from .._planning._planner import plan, progress_to

    rows = row_count(first)
    if not rows:
        raise EvendpError(
            "the first batch holds no tensor with a batch dimension (dim 0) to plan; "
            "return tensors of one row per sample from the dataset or collate_fn"
        )

    def example(n: int) -> Any:
        return as_args(_rows_like(first, rows, n))

    loss_module = copy.deepcopy(trainer.wrapped.module).cpu()
    try:
        with progress_to(say):
            return plan(
                loss_module, example, list(memory), mode="dp", batch_size=batch,
                amp=trainer.config.amp, cuda_context=0,
            )  # fmt: skip
    except PlanError as exc:
        shown = ",".join(format_bytes(m).replace(" ", "") for m in memory)
        raise EvendpError(
            f"batch_size={batch} on memory {shown}: {exc} (or raise the budgets, or shrink the "
            "model)"
        ) from None


def _rows_like(batch: Any, rows: int, n: int) -> Any:
    """``batch`` (of ``rows`` rows) with ``n`` rows: fresh zero tensors of its dtypes and
    per-row shapes, and its per-row lists repeated, as ``n`` collated samples would be.

    Under the planner's ``FakeTensorMode`` the zeros are fake: no memory, no sample read.

    >>> ids, names = _rows_like((torch.ones(2, 5, dtype=torch.long), ["a", "b"]), 2, 3)
    >>> tuple(ids.shape), ids.dtype, names
    ((3, 5), torch.int64, ['a', 'b', 'a'])
    """

    def grow(t: torch.Tensor) -> torch.Tensor:
        shape = (n, *t.shape[1:]) if t.dim() else ()  # 0-dim: not split, kept
        return torch.zeros(shape, dtype=t.dtype, device=t.device)

    return map_tensors(
        batch, grow, rows=rows, row_fn=lambda values: [values[i % rows] for i in range(n)]
    )


def rehearse(
    model: torch.nn.Module,
    data: Any,
    config: Any,
    *,
    memory: str | Sequence[int | str],
    scale: float = 1.0,
    weights: Literal["auto"] | Sequence[float] | None = "auto",
    say: Callable[[str], None] | None = print,
    **trainer_args: Any,
) -> TrainReport:
    """Train ``model`` on CPU virtual devices that enforce the memory ``memory`` states.

    A dress rehearsal of a run on GPUs of unequal memory, on a laptop: each replica's forward
    is held to its budget (past it, ``torch.OutOfMemoryError`` there, as a full GPU would).
    Before training, an even split of the first batch (what ``nn.DataParallel`` runs) is tried
    once; where it does not fit, ``say`` prints which device ran out and the report marks it
    ``OOM``.

    Args:
        model, data, config: as for :class:`evendp.Trainer` (``config.batch_size`` is the
            global batch).
        memory: each device's budget: ``"24MiB,12MiB"``, ``"2x12MiB"`` or a list of sizes.
        scale: every budget is multiplied by it (``1/1024``: GiB read as MiB).
        weights: ``"auto"``: the planner's split for the budgets (:func:`evendp.plan`; an
            :class:`EvendpError` when the batch cannot fit), per-device weights, or ``None``:
            the even split (whose out-of-memory shares the Trainer re-splits, the gradient
            unchanged).
        say: where the lines before training go (the planner's progress, the split, the even
            split's outcome); ``None``: nowhere.
        trainer_args: the other :class:`evendp.Trainer` arguments (``loss_fn``,
            ``count_fn``, ``collate_fn``, ``callbacks``, ...).

    Returns the :class:`TrainReport` (written to ``config.out_dir`` when set), with each
    device's budget, measured forward peak (``peak_bytes``, ``peak_kind="forward"``), the
    planner's peaks and the even split's share, measured forward and ``even_oom``.

    >>> from evendp import TrainConfig
    >>> torch.manual_seed(0) and None
    >>> data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    >>> net = torch.nn.Sequential(torch.nn.Linear(8, 256), torch.nn.ReLU(),
    ...                           torch.nn.Linear(256, 2))
    >>> loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])
    >>> cfg = TrainConfig(steps=2, batch_size=64, progress=False)
    >>> report = rehearse(net, data, cfg, memory="256GiB,64GiB", scale=2**-20, weights=[3, 1],
    ...                   loss_fn=loss)  # doctest: +ELLIPSIS
    2 virtual devices ['cpu:0', 'cpu:1'] with budgets 256.0KiB,64.0KiB, ...
    the even split [32, 32] (what nn.DataParallel runs) fails: virtual device cpu:1 ...
    >>> [d.even_oom for d in report.devices], [d.samples_per_step for d in report.devices]
    ([False, True], [48.0, 16.0])
    >>> all(d.peak_bytes <= d.budget_bytes for d in report.devices)
    True
    """
    from ._trainer import Trainer

    budgets = _budgets(memory, scale)
    for name in ("device_ids", "devices"):
        if name in trainer_args:
            raise EvendpError(
                f"rehearse makes one CPU virtual device per memory entry; drop {name}= "
                f"(got {trainer_args[name]!r}) and give memory= one budget per device"
            )
    devices: list[str | int | torch.device] = ["cpu"] * len(budgets)
    listed = isinstance(weights, list | tuple) and all(
        isinstance(w, int | float) and not isinstance(w, bool) for w in weights
    )  # the values: BalancedDataParallel checks them
    if weights is not None and weights != "auto" and not listed:
        raise EvendpError(
            f"weights={shown_value(weights)}: give 'auto' (the planner's split), per-device "
            "weights such as [3, 1], or None (the even split)"
        )
    validate_callable("say", say, "a function of one str such as print", allow_none=True)
    tell = say or (lambda line: None)
    fixed = None if weights is None or isinstance(weights, str) else [float(w) for w in weights]
    trainer = Trainer(model, data, config, device_ids=devices, weights=fixed, **trainer_args)
    dp: Any = trainer.wrapped  # BalancedDataParallel: one process
    # The batch the first step trains (the sampler is deterministic in its epoch): what the
    # planner sizes and the even split tries.
    trainer.sampler.set_epoch(0)
    first = trainer.collate(list(next(iter(trainer.sampler))))
    planned = None
    if weights == "auto":
        tell(f"planning the split of {config.batch_size} samples over {len(budgets)} "
             "devices (fake steps at a few sizes) ...")  # fmt: skip
        planned = plan_for(trainer, budgets, config.batch_size, first=first, say=say)
        dp.weights = [float(n) for n in planned.split]
    budget = attach_budgets(trainer, budgets)
    shown = ",".join(format_bytes(b).replace(" ", "") for b in budgets)
    source = "the planner's split" if planned is not None else "weights " + str(weights)
    tell(f"{len(budgets)} virtual devices {trainer.device_names} with budgets {shown}, "
         f"global batch {config.batch_size}: {dp.split(config.batch_size)} "
         f"({source})")  # fmt: skip
    even, line = probe_even_split(trainer, budget, first)
    tell(line)
    report = trainer.fit()
    for i, (share, peak, oom) in enumerate(even):
        d = report.devices[i]
        d = replace(d, even_samples=share, even_forward_peak_bytes=peak, even_oom=oom)
        if planned is not None:
            p = planned.devices[i]
            d = replace(d, planned_bytes=p.peak, even_planned_bytes=p.even_peak)
        report.devices[i] = d
    if config.out_dir is not None and trainer.rank == 0:
        write_report(report, Path(config.out_dir))
    return report


def _budgets(memory: str | Sequence[int | str], scale: float) -> list[int]:
    validate_float("scale", scale, positive=True, example="scale=1/1024 (GiB read as MiB)")
    if not isinstance(memory, (str, list, tuple)) or not memory:
        raise EvendpError(
            f"memory must be the devices' budgets, got {memory!r}; e.g. memory='24MiB,12MiB'"
        )
    try:
        declared = [m.free for m in parse_memory(memory)]
    except EvendpError as exc:
        raise EvendpError(f"memory={memory!r}: {exc}") from None
    budgets = [int(m * scale) for m in declared]
    if min(budgets) < 1:
        raise EvendpError(
            f"memory={memory!r} times scale={scale!r} leaves a budget under 1 byte; raise "
            "scale or the budgets"
        )
    return budgets
