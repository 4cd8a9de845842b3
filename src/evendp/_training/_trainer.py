"""The training loop that composes evendp: one readable loop in the style of nanoGPT.

Each optimizer step takes one global batch (``batch_size`` samples), laid out over ranks and
devices by the sampler's :class:`~evendp._distributed._step_layout.StepLayout`, collated
(ahead in a thread with a GPU: :mod:`evendp._parallel._prefetch`) and trained by
:func:`~evendp._training._step.train_step`, which reads top to bottom and calls the strategy
(:mod:`evendp._training._strategies`: every decision that differs between one process, DDP,
FSDP2, ... is the strategy's). What the step returned goes to the run's
:class:`~evendp._training._recorder.Recorder` (the position, the bar, callbacks, the report).
The gradient is that of the global batch's mean loss however the batch is cut (devices, ranks,
micro-steps, OOM re-splits): the arithmetic is :mod:`evendp._core._exact`'s.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from .._core import _defaults as defaults
from .._core._amp import amp_dtype
from .._core._blocks import block_predicate, repeated_blocks
from .._core._calls import as_batch
from .._core._cost import sample_costs
from .._core._counting import auto_count, holds_ignored, uncounted_warning
from .._core._errors import EvendpError
from .._core._exact import share_loss
from .._distributed._batch_plan import DEFAULT_BATCH_SIZE, global_batch_size
from .._distributed._collate import EmptySafeCollate
from .._distributed._interrupt import StopFlag, late_signal
from .._distributed._launch_notes import note_training
from .._distributed._stalled import (
    DEFAULT_COMM_TIMEOUT_S,
    RankStalled,
    is_comm_failure,
    set_comm_timeout,
)
from .._distributed._step_layout import StepLayout
from .._parallel._prefetch import Prefetcher, Prepared, pin, wants_pinning
from .._parallel._scatter import row_count
from .._planning._balance import first_batch, inline_for_balance
from .._planning._on_device import forget as forget_plans
from . import _peak_memory
from ._checkpointer import Checkpointer
from ._evaluate import EvalFn, EvalRun, loss_eval_fn
from ._first_step_watch import first_step_watch
from ._launched import join_launch
from ._recorder import Callbacks, Recorder, TrainState
from ._report import TrainReport, write_report
from ._stateful import OomCaps, PerRank, RngState, SamplerPosition
from ._step import StepWeight, count_weight, no_batch_dimension, sample_counts, train_step
from ._strategies import pick_strategy
from ._strategies._base import SamplerInputs
from ._train_inputs import checked_loss, validate_config, validate_trainer_args

__all__ = ["TrainConfig", "Trainer", "default_loss"]

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
CountFn = Callable[[Batch], "int | torch.Tensor"]


@dataclass
class TrainConfig:
    """Settings of a :class:`Trainer` run.

    ``batch_size`` is the global batch per optimizer step; ``batch_sizes`` each rank's share of
    it under ``torchrun`` (given alone, ``batch_size`` is their sum; both: they must agree).
    ``accum`` splits each step into that many micro-batches (gradient accumulation); the
    gradient is unchanged. Under ``torchrun``,
    ``batch_sizes="auto"`` splits ``batch_size`` by each rank's memory (planned at start, the
    same on every rank) and ``balance="speed"`` moves samples from slow ranks to fast ones at
    step boundaries, the same samples per step (docs/balancing.md).

    >>> TrainConfig(steps=10, amp="bf16").amp
    'bf16'
    """

    steps: int = defaults.STEPS
    batch_size: int = DEFAULT_BATCH_SIZE  # 32, told apart from a given 32
    batch_sizes: list[int] | Literal["auto"] | None = None  # per rank, torchrun; None: even
    accum: int = 1
    lr: float = defaults.LR
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    amp: Literal["none", "bf16", "fp16"] = "none"
    activation_checkpointing: bool = False
    oom_resplit: bool = True
    # A name of the strategy registry: under a launcher "ddp", "fsdp2", ...; in one process
    # every name runs "dp" (BalancedDataParallel over device_ids).
    strategy: str = "ddp"
    # The strategy's own settings, for a strategy that reads some (a dict, or a JSON file's
    # path); None: its defaults.
    strategy_config: dict[str, Any] | str | Path | None = None
    out_dir: str | Path | None = None
    # With out_dir: steps between checkpoints (0: only at the end and on Ctrl-C)
    checkpoint_every: int = defaults.NotGiven(defaults.CHECKPOINT_EVERY)
    resume: bool = False
    seed: int = defaults.SEED
    progress: bool = True
    log_every: int = 10  # steps between the progress bar's loss reads (the report has all)
    prefetch: int | None = None  # batches collated ahead in a thread; None: 2 with a GPU, else 0
    eval_every: int = 0  # steps between evaluations of eval_data; 0: only after the last step
    balance: Literal["none", "speed"] = "none"  # "speed": move samples to fast ranks (torchrun)
    # Steps with a NaN/inf gradient are skipped; this many in a row stop the run (TrainingError).
    # Decided on the device with the default (fused) AdamW, read at log steps; other
    # optimizers read the gradient norm on the host each step. 0 turns it off.
    max_nonfinite_steps: int = 3
    # Under torchrun: seconds a collective waits for the other ranks, from the first step on;
    # past it the run stops (RankStalled, exit 1) instead of hanging. None: the group's own.
    comm_timeout: float | None = DEFAULT_COMM_TIMEOUT_S
    # Steps of linear learning-rate warmup (lr * k / warmup_steps at step k), then constant;
    # 0: none. For the Trainer's own schedule: with scheduler= put the warmup in it.
    warmup_steps: int = 0  # last: a new field never shifts the positional ones

    def __post_init__(self) -> None:
        validate_config(self)  # every field, at construction (evendp._training._train_inputs)
        self.batch_size = global_batch_size(self.batch_size, self.batch_sizes)  # one meaning


def default_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """The model's own loss: ``model(**batch)`` for a dict batch, ``model(x, y)`` for an
    ``(inputs, targets)`` tuple.

    The loss is the output itself when it is a tensor; its ``loss`` (a Hugging Face
    ``ModelOutput``, a dict); else the loss of a tuple: ``(logits, loss)`` after ``(x, y)``
    (nanoGPT's shape), ``(loss, logits, ...)`` after a dict (Hugging Face's
    ``return_dict=False``).

    >>> class NanoStyle(nn.Module):
    ...     def forward(self, x, y):
    ...         return x * 2, (x - y).abs().mean()
    >>> default_loss(NanoStyle(), (torch.ones(2), torch.zeros(2)))
    tensor(1.)
    >>> class HFStyle(nn.Module):
    ...     def forward(self, input_ids, labels):
    ...         return {"loss": (input_ids - labels).abs().mean(), "logits": input_ids}
    >>> default_loss(HFStyle(), {"input_ids": torch.ones(2), "labels": torch.zeros(2)})
    tensor(1.)
    """
    if isinstance(batch, Mapping):
        return loss_of(model(**batch), loss_first=True)
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        got = f"a batch of {len(batch)} items" if isinstance(batch, (tuple, list)) else "it"
        raise EvendpError(
            f"the default loss_fn calls model(**batch) on a dict batch or model(x, y) on an "
            f"(inputs, targets) batch, but got {got}; return one of those from the dataset, "
            "or pass loss_fn=lambda model, batch: ... (the batch's mean loss)"
        )
    x, y = batch
    _check_takes_targets(model)
    return loss_of(model(x, y), loss_first=False)


def _check_takes_targets(model: nn.Module) -> None:
    """A model whose ``forward`` cannot take ``(x, y)`` returns logits, not a loss: say what
    to pass instead of torch's "forward() takes 2 positional arguments but 3 were given"."""
    forward = model.__dict__.get("forward") or type(model).forward  # per class, or patched
    if not _takes_two(forward):
        name = type(model).__name__
        raise EvendpError(
            f"the default loss_fn calls model(x, y) on an (inputs, targets) batch and takes the "
            f"loss it returns, but {name}.forward does not take the targets (it returns "
            "outputs, not a loss); pass loss_fn, e.g. loss_fn=lambda model, batch: "
            "torch.nn.functional.cross_entropy(model(batch[0]), batch[1])"
        )


@functools.lru_cache(maxsize=64)
def _takes_two(forward: Callable[..., Any]) -> bool:
    """Whether ``forward`` (a class's, taking ``self``; or an instance's own) takes two more
    positional arguments; ``True`` where it has no signature to read (the call then says)."""
    try:
        signature = inspect.signature(forward)
    except (TypeError, ValueError):
        return True
    unbound = next(iter(signature.parameters), None) == "self"
    try:
        signature.bind(*([None] * (3 if unbound else 2)))
    except TypeError:
        return False
    return True


def loss_of(out: Any, *, loss_first: bool) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping) and "loss" in out:
        return out["loss"]
    if isinstance(getattr(out, "loss", None), torch.Tensor):
        return out.loss
    if isinstance(out, tuple) and len(out) > 1:
        return out[0] if loss_first else out[1]
    raise EvendpError(
        f"the default loss_fn found no loss in the model's output ({type(out).__name__}); "
        "return the loss (a tensor, .loss, or (logits, loss)), or pass loss_fn="
    )


class _LossModule(nn.Module):
    """Runs ``loss_fn(model, batch)`` inside ``forward``; returns the loss *summed* over the
    batch's counted items (``count_fn(batch)``, else its rows), exactly 0 (not NaN) with none.

    So each replica, rank and micro-batch returns a sum, no logits are gathered, and the
    step's loss is the sum of the sums over the step's global count, whatever the split.

    >>> net = nn.Linear(2, 3)
    >>> def loss_fn(model, batch):
    ...     x, y = batch
    ...     return nn.functional.cross_entropy(model(x), y)
    >>> m = _LossModule(net, loss_fn, count_fn=lambda b: (b[1] != -100).sum())
    >>> m(torch.ones(2, 2), torch.tensor([-100, -100]))  # no counted items: 0, not NaN
    tensor(0., grad_fn=<WhereBackward0>)
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn, count_fn: CountFn | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.count_fn = count_fn

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        # A dict batch arrives as its one argument (or, from the planner, as keywords).
        batch = as_batch(args, kwargs)
        loss = self.loss_fn(self.model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            checked_loss(loss)  # raises, naming the fix
        count = row_count(batch) if self.count_fn is None else self.count_fn(batch)
        if not isinstance(count, (int, float, torch.Tensor)):
            count = torch.as_tensor(count)  # e.g. a NumPy integer
        return share_loss(loss, count)  # the share's part: summed over its items


def _keep_batchnorm_fp32(model: nn.Module) -> None:
    # Autocast never casts parameters, so BatchNorm weights and running statistics stay fp32;
    # feeding it fp32 inputs keeps its arithmetic (and the running stats' updates) in fp32 too.
    def to_fp32(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.register_forward_pre_hook(to_fp32)


def _apply_activation_checkpointing(model: nn.Module) -> None:
    # Recompute each repeated block (the children of a ModuleList, e.g. transformer layers)
    # in backward instead of keeping its activations. The wrapper keeps state_dict keys.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    if not repeated_blocks(model):
        raise EvendpError(
            "activation_checkpointing found no nn.ModuleList of blocks in the model; "
            "hold the repeated layers in an nn.ModuleList or turn the option off"
        )
    apply_activation_checkpointing(model, check_fn=block_predicate(model))


class Trainer:
    """Train ``model`` on ``data`` with balanced DP (one process) or uneven DDP (torchrun).

    Args:
        model: anywhere but ``meta``: moved, when it is elsewhere, to ``device_ids[0]``
            (one process) or under NCCL to this rank's GPU, and said in one line (under
            gloo a rank runs where the model sits).
        data: a map-style dataset; a ``batch(indices)`` method is used when present.
        config: a :class:`TrainConfig`.
        device_ids: one process: the device list for BalancedDataParallel (repeats are
            virtual devices). DDP: ignored (the model's device is used).
        weights: per-device weights for the split (``None``: even; ``"auto"``, as
            ``TrainConfig(batch_sizes="auto")`` in one process: the planner's split for each
            device's memory, declared in ``EVENDP_MEMORY`` or read live on GPUs, printed).
        loss_fn: ``loss_fn(model, batch) -> mean loss``; default :func:`default_loss`.
            The batch is what the dataset's collate made: a dict as the dict itself, a
            tuple as the tuple, a lone tensor as ``(tensor,)``. ``count_fn`` gets the same batch.
        count_fn: ``count_fn(batch) -> counted items`` (int or 0-dim tensor) that
            ``loss_fn``'s mean is over, e.g. non-ignored tokens (:func:`evendp.count_tokens`);
            ``None``: samples, except that the default loss of a Hugging Face model whose
            class names its task (``*ForCausalLM``, ``*ForMaskedLM``, ...) counts the
            batch's non-ignored ``labels``, shifted for a causal LM; a batch holding ``-100``
            labels with neither warns once, naming ``count_fn``. Every
            micro-batch and every device's share is then weighted by its count over the
            step's global count, so the step's loss is the mean over all counted items
            however the batch is cut; a share with no counted items adds exactly nothing.
            ``count_fn`` must add up over rows (the count of a batch is the sum of its rows').
        optimizer: default AdamW(lr, weight_decay).
        scheduler: default none.
        costs: per-sample cost (a sequence, or a function of ``data[i]``: its length in
            tokens) to split each step by padded cost, not by count (docs/balancing.md).
            DDP: the sampler assigns the step's samples to ranks by cost. One process: the
            step's rows are ordered so each device's contiguous share is its cost plan.
            The step's samples and its gradient (weighted by ``count_fn``) are unchanged.
        max_costs: with ``costs``, a cap per device (DDP: per rank) in cost units, e.g.
            ``plan(..., seq_len=L).max_tokens``; a step that cannot fit raises EvendpError.
        max_tokens: with ``costs``, each step's global batch is a token budget (fairseq's
            ``max_tokens``): samples are taken while their summed cost fits, then split by
            cost; ``config.batch_size``/``batch_sizes`` are then the capacities only.
        counts: with ``count_fn``, each sample's counted items (a sequence, or a function of
            ``data[i]``): what ``count_fn`` counts on that sample alone. The step's global
            count is then their sum over the step's samples, known to every rank: under
            DDP/FSDP2 no all-reduce per step (without it: one, overlapping the forward).
        eval_data: a map-style dataset evaluated every ``config.eval_every`` steps and after
            the last step (``eval_every=0``: only then), in order, every sample exactly once
            over all devices and ranks, under ``torch.no_grad`` with the model in eval mode.
            Results: ``TrainReport.eval``, the progress bar, ``report.json`` and the PNG.
        eval_fn: ``eval_fn(model, batch) -> {name: (sum, count)}``; each metric is
            ``total sum / total count``, exactly one device's over the whole set. Default:
            ``{"loss": (loss_fn's mean x count, count)}``, counted by ``count_fn`` (else
            the samples), as training weights the loss.
        collate_fn: ``collate_fn(samples) -> batch`` for a dataset of samples that
            ``default_collate`` cannot stack, e.g. variable-length sequences to pad;
            default: ``data.batch(indices)`` when the dataset has it, else
            ``default_collate``.
        callbacks: objects with optional hooks ``on_fit_start``, ``on_step_end``, ``on_log``,
            ``on_eval``, ``on_save``, ``on_fit_end`` (:class:`evendp.Callback`), e.g. the
            shipped loggers :class:`evendp.TensorBoardLogger`, :class:`evendp.CSVLogger`,
            :class:`evendp.MLflowLogger`, :class:`evendp.WandbLogger`. ``on_log`` gets the
            loss every ``config.log_every`` steps (under torchrun every rank joins those reads
            when any rank has callbacks).

    Batches: a dataset with a ``batch(indices) -> batch`` method builds each step's batch
    itself from the step's sample indices (one call, no per-sample ``__getitem__``; e.g.
    slicing a token tensor, or padding variable-length samples to the longest, as
    :class:`evendp.examples.stdlib_text.CodeParagraphs` does). Without it, and without
    ``collate_fn``, samples are stacked by ``default_collate``, which needs equal shapes.

    With ``config.out_dir`` set, ``fit`` also writes the report there (``report.txt``,
    ``report.json``, ``report.png``), as ``evendp train`` does.

    >>> from evendp.examples.stdlib_text import CharWindows
    >>> torch.manual_seed(0) and None
    >>> data = CharWindows(torch.randint(0, 5, (200,)), block_size=4)
    >>> class Bigram(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = nn.Embedding(5, 5)
    ...     def forward(self, x, y):
    ...         return nn.functional.cross_entropy(self.emb(x).view(-1, 5), y.view(-1))
    >>> cfg = TrainConfig(steps=5, batch_size=12, lr=0.1, progress=False)
    >>> report = Trainer(Bigram(), data, cfg, device_ids=["cpu", "cpu"], weights=[2, 1]).fit()
    >>> report.steps, [d.samples_per_step for d in report.devices]
    (5, [8.0, 4.0])
    >>> report.final_loss < report.first_loss
    True
    """

    def __init__(
        self,
        model: nn.Module,
        data: Dataset[Any],
        config: TrainConfig,
        *,
        device_ids: list[str | int | torch.device] | None = None,
        weights: list[float] | Literal["auto"] | None = None,
        loss_fn: LossFn = default_loss,
        count_fn: CountFn | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        eval_data: Dataset[Any] | None = None,
        eval_fn: EvalFn | None = None,
        costs: Sequence[float] | Callable[[Any], float] | None = None,
        collate_fn: Callable[[list[Any]], Batch] | None = None,
        max_costs: Sequence[float] | None = None,
        max_tokens: float | None = None,
        counts: Sequence[float] | Callable[[Any], float] | None = None,
        callbacks: Sequence[Any] | None = None,
    ) -> None:
        validate_trainer_args(
            model, data, config, TrainConfig, loss_fn=loss_fn, count_fn=count_fn,
            optimizer=optimizer, scheduler=scheduler, eval_data=eval_data, eval_fn=eval_fn,
            device_ids=device_ids, weights=weights, collate_fn=collate_fn, costs=costs,
            max_costs=max_costs, counts=counts,
        )  # fmt: skip
        # Under a launcher (evendp launch, torchrun): the ranks' process group, started here.
        join_launch(config.strategy)
        self.config = config
        self.model = model
        self.data = data
        if count_fn is None and loss_fn is default_loss:
            # The model's own loss of a recognised Hugging Face model: a mean over its labels
            # (shifted for a causal LM). Read from the model's class, the same on every rank.
            count_fn = auto_count(model)
        self.count_fn = count_fn
        self._count_checked = count_fn is not None  # else: warned once on ignored labels
        self._amp_dtype = amp_dtype(config.amp)  # autocast's dtype (None: no autocast)
        if config.amp != "none":
            _keep_batchnorm_fp32(model)
        if config.activation_checkpointing:
            _apply_activation_checkpointing(model)
        forget_plans()  # the first-step watch checks this Trainer's own plan, none before it
        self.strategy = strategy = pick_strategy(model, config, device_ids, weights)
        self.rank, self.world = strategy.rank, strategy.world
        self.device = strategy.device
        strategy.wrap(_LossModule(model, loss_fn, count_fn), optimizer)
        self.wrapped = strategy.wrapped
        self.device_names = strategy.device_names
        self.sampler, self.balancer, device_costs, self._max_costs = strategy.sampler(
            SamplerInputs(
                data, config, costs, max_costs, max_tokens,
                model=lambda: _LossModule(model, loss_fn, count_fn),
                example=lambda: first_batch(data, collate_fn),
            )
        )  # fmt: skip
        # The cost plan inside this process (one process: each device's contiguous share).
        self._costs = sample_costs(data, self.sampler.num_samples, device_costs)
        self._counts = sample_counts(data, self.sampler.num_samples, counts)
        # A micro-batch cap per device, so an OOM shrinks only the failing share.
        # oom_resplit=False: an OOM propagates, as in plain PyTorch.
        self.guard = strategy.guard(config.oom_resplit)
        out = config.out_dir
        where = "" if out is None else f"; the last good checkpoint is in {out}"
        # Built after wrapping: FSDP2 replaces the parameters with sharded ones.
        #: Backward and the update (:class:`~evendp._training._step.Stepper`).
        self.stepper = strategy.build_stepper(optimizer, scheduler, config, where=where)
        # A dataset without batch(indices) is collated per sample; an empty share (a rank of
        # size 0, or the short last step) gives zero-length tensors rather than an IndexError.
        # An explicit collate_fn wins over the dataset's batch(indices).
        batch_fn = getattr(data, "batch", None) if collate_fn is None else None
        self._batch_fn: Callable[[list[int]], Batch] | None = (
            batch_fn if callable(batch_fn) else None
        )
        self._collate = EmptySafeCollate(data, collate_fn)
        self._pin = wants_pinning(self.strategy.devices)
        # With a GPU the host is free while the device computes: collate ahead in a thread.
        # CPU devices are the host's own cores: a thread only competes with them for the GIL
        # (measured: +1.5 ms CPU per step on a 13 ms step), so there the loop collates inline.
        self._prefetch = (2 if self._pin else 0) if config.prefetch is None else config.prefetch
        self._prefetch = inline_for_balance(self.balancer, config.prefetch, self._prefetch)
        self._stand_in: Batch | None = None
        # Each rank's rows over its devices: by the strategy's weights, or by cost (costs=,
        # max_costs=); with one device per process and no caps, the layout's own rows.
        self._one_device = len(strategy.devices) == 1 and self._max_costs is None
        # Autocast's context, and the speed balancer's timer around each part of the step
        # it times (the forward always; backward and the optimizer step where the strategy
        # runs them without waiting for another rank: its local_parts). None: nothing runs.
        self.autocast: Callable[[], contextlib.AbstractContextManager[Any]] = (
            contextlib.nullcontext
            if self._amp_dtype is None
            else functools.partial(torch.autocast, self.device.type, dtype=self._amp_dtype)
        )
        measure = self.balancer.measure if self.balancer.active else contextlib.nullcontext
        self.timers: dict[str, Callable[[int], contextlib.AbstractContextManager[Any]]] = {
            part: measure if part in ("forward", *strategy.local_parts) else contextlib.nullcontext
            for part in ("forward", "backward", "optimizer")
        }
        self.state = TrainState(devices=len(self.device_names))
        # What a resume must match: the same global batch keeps the remaining sample order.
        global_batch = sum(self.sampler.batch_sizes)  # one process: config.batch_size
        self.state.run_config = {"global_batch": global_batch, "mode": self.strategy.name}
        #: The last step's micro-steps: per micro-step, the samples each device ran.
        self.micro_steps: list[list[int]] = []
        self._saved_step: int | None = None  # the step of the checkpoint on disk, if known
        self.eval_data = eval_data
        self.eval_fn = eval_fn if eval_fn is not None else loss_eval_fn(loss_fn, count_fn)
        #: Every evaluation so far: ``{"step": step, "metrics": {name: value}}``.
        self.evals: list[dict[str, Any]] = []
        self.callbacks = Callbacks(callbacks)
        # Live CUDA devices planned by this process: their first step is checked against it.
        watch = first_step_watch(self.strategy.devices, self.world)
        self.watches = Callbacks(None if watch is None else [watch])
        #: A :class:`~evendp._training._budget.MemoryBudgets` enforced on the virtual devices
        #: (set by :func:`evendp.rehearse`): its measured peaks join the bar and the report.
        self.memory_budgets: Any = None
        #: What the run shows and reports (:class:`~evendp._training._recorder.Recorder`).
        self.recorder = Recorder(self)

    # The run's position lives in self.state; these read it under the old names.
    step = property(lambda self: self.state.step)
    losses = property(lambda self: self.state.losses)
    samples = property(lambda self: self.state.samples)
    # The optimizer's part of the step is the stepper's (built after wrapping).
    optimizer = property(lambda self: self.stepper.optimizer)
    scheduler = property(lambda self: self.stepper.scheduler)
    scaler = property(lambda self: self.stepper.scaler)

    # -- checkpoints -------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path | None:
        """``out_dir/ckpt.pt``, or the ``out_dir/ckpt.dcp`` folder under FSDP2 (``None``: none)."""
        out = self.config.out_dir
        return None if out is None else Path(out) / self.strategy.checkpoint_format.name

    @functools.cached_property
    def _checkpointer(self) -> Checkpointer:
        # One for the run: it remembers a corrupt latest file, which a save must not rotate.
        return Checkpointer(
            self.strategy.checkpoint_format, rank=self.rank, run_config=self.state.run_config
        )

    def save(self) -> Path | None:
        """Write a checkpoint now (every rank calls it); returns its path (``None`` on ranks > 0).

        One process and DDP: rank 0 writes ``ckpt.pt``, the other ranks their RNG files.
        FSDP2: every rank writes its shards into ``ckpt.dcp`` (torch.distributed.checkpoint).
        """
        path = self.checkpoint_path
        if path is None:
            return None
        self._read_pending()  # every rank saves: the collectives pair
        saved = self._checkpointer.save(path, self._checkpointed())
        self._saved_step = self.state.step
        saved = saved if self.rank == 0 else None
        self.callbacks.call("on_save", self, self.state.step, saved)
        return saved

    def resume(self) -> bool:
        """Load the latest good checkpoint in ``out_dir``; False (a fresh start) if none.

        Every rank calls it. Each rank's generators come back from its own state; a rank the
        saved run did not have is reseeded from (seed, rank, step) with a warning.
        """
        path = self.checkpoint_path
        if path is None:
            return False
        notes = self._checkpointer.resume(path, self._checkpointed())
        if notes is None:
            return False
        self.state.notes = notes
        self._saved_step = self.state.step
        self.recorder.say_resumed(notes, self._checkpointer.received)
        return True

    def _checkpointed(self) -> dict[str, Any]:
        """The run's state, by part (:mod:`evendp._training._stateful`); ``None``: not in
        this run. One more part is one more line."""
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "scaler": self.scaler,
            "train": self.state,
            "rng": PerRank(RngState(reseed=self.config.seed * 1_000_003 + self.rank)),
            "data": PerRank(SamplerPosition(self.sampler, self.state)) if self.world > 1 else None,
            "guard": OomCaps(self.guard),
            "balancer": self.balancer if self.balancer.active else None,
            "nonfinite": self.stepper.gate,
        }

    # -- data --------------------------------------------------------------------------------

    def collate(self, indices: list[int]) -> Batch:
        """The batch of the samples ``indices``, as a step builds it (not yet placed)."""
        if self._batch_fn is not None:
            return self._batch_fn(indices)
        if not indices:  # an empty share: a batch of 0 rows
            return self._collate(indices)
        return self._collate.collate_fn([self.data[i] for i in indices])

    def _prepare(self, epoch: int, skip: int) -> Iterator[Prepared]:
        """Every step's batch from ``(epoch, skip)`` on, collated (and pinned) in order."""
        # The sampler is deterministic in (seed, epoch): skipping the batches already trained
        # puts a resumed run exactly where it stopped.
        while True:
            self.sampler.set_epoch(epoch)
            for i, layout in enumerate(self.sampler.layouts()):
                if i < skip:
                    continue
                if not self._one_device:
                    layout = self._on_devices(layout)
                batch = self.collate(layout.rank_indices(self.rank))
                if self._pin:
                    batch = pin(batch)
                # Every rank knows every rank's share: the global count needs no all-reduce.
                counted = None if self._counts is None else layout.count(self._counts)
                yield Prepared(batch, epoch, i, layout, counted)
            epoch, skip = epoch + 1, 0

    def _on_devices(self, layout: StepLayout) -> StepLayout:
        """The step's layout with each rank's rows on its devices: by the strategy's weights,
        or by cost with those as capacities (``costs=``; ``max_costs`` caps each device)."""
        try:
            return layout.on_devices(self.strategy.shares, self._costs, self._max_costs)
        except EvendpError as err:
            raise EvendpError(f"a step of {layout.samples} samples: {err}") from None

    def warn_uncounted(self, batch: Batch) -> None:
        """Once per run without ``count_fn`` (the first step): warn when the batch holds
        ``-100`` labels that a mean by samples would count (a host read of the labels)."""
        self._count_checked = True
        if holds_ignored(batch):
            uncounted_warning("Trainer(count_fn=None)", self.model, stacklevel=5)

    def stand_in(self) -> Batch:
        """One real sample for a rank with no rows: models may reject an empty batch."""
        if self._stand_in is None:
            self._stand_in = self.strategy.place(self.collate([0]))
        return self._stand_in

    # -- evaluation --------------------------------------------------------------------------

    def _evaluate(self) -> dict[str, float] | None:
        """Evaluate ``eval_data`` now (on every rank: the sums meet in one gather); record it."""
        data = self.eval_data
        if data is None:
            return None
        # Collated as training is: an explicit collate_fn wins over eval_data's batch(indices).
        collate_fn = self._collate.collate_fn  # the user's, else default_collate
        batch_fn = getattr(data, "batch", None) if collate_fn is default_collate else None
        empty_safe = EmptySafeCollate(data, collate_fn)
        collate = batch_fn if callable(batch_fn) else lambda ix: empty_safe([data[i] for i in ix])
        run = EvalRun(
            self.model, data, self.eval_fn, list(self.sampler.batch_sizes), collate, self.autocast
        )
        metrics = self.strategy.evaluate(run)
        self.evals.append({"step": self.step, "metrics": metrics})
        self.callbacks.call("on_eval", self, self.step, dict(metrics))
        return metrics

    # -- one step ----------------------------------------------------------------------------

    def batch_loss(self, batch: Batch) -> torch.Tensor:
        """The mean loss of this process's ``batch`` over its counted items, split over the
        devices as a step splits it (forward only; ``backward()`` gives its gradient).

        >>> from evendp.examples.stdlib_text import CharWindows
        >>> data = CharWindows(torch.randint(0, 5, (50,)), block_size=4)
        >>> bigram = lambda m, b: nn.functional.cross_entropy(m(b[0]).view(-1, 5), b[1].view(-1))
        >>> t = Trainer(nn.Embedding(5, 5), data, TrainConfig(progress=False),
        ...             device_ids=["cpu"] * 2, loss_fn=bigram)
        >>> batch = t.collate([0, 1, 2])
        >>> torch.allclose(t.batch_loss(batch), bigram(t.model, batch))
        True
        """
        n = row_count(batch)
        if n is None:
            raise no_batch_dimension(batch)
        batch = self.strategy.place(batch)
        weight = (
            StepWeight.known(self.world, n) if self.count_fn is None else count_weight(self, batch)
        )
        with self.autocast():
            total = self.strategy.forward(batch, self.strategy.shares(n))
        return total * weight.wait() / self.world

    def _device_peaks(self) -> list[int | None]:
        """Per device of the report, its GPU's peak reserved bytes (``None``: not a GPU, or
        another rank's); replicas on one GPU each give that GPU's one figure."""
        mine = _peak_memory.device_peaks(self.strategy.devices)
        before = self.rank * len(mine)
        return [None] * before + mine + [None] * (len(self.device_names) - before - len(mine))

    # -- the loop ----------------------------------------------------------------------------

    def _read_pending(self) -> None:
        """Where the host reads (log steps, checkpoints, the report): the steps' losses and
        skip flags, summed over processes in one collective, and what the optimizer step left
        pending (the schedule; the non-finite gate's verdict, which may stop the run)."""
        self.stepper.settle()
        self.state.flush(self.strategy.reduce_losses)

    def fit(self) -> TrainReport:
        """Run until ``config.steps`` optimizer steps are done; return the report.

        SIGINT or SIGTERM stops the run after the step in progress (under DDP/FSDP2 every rank
        after the same step: the ranks agree on the flag each step), saves a checkpoint (when
        ``out_dir`` is set) and returns the report so far with ``interrupted=True`` and the
        signal's number in ``signal``. The previous signal handlers are back afterwards.
        """
        stop = StopFlag()
        with self.strategy.running(self.config.out_dir, stop), stop:
            try:
                return self._fit(stop)
            except RuntimeError as error:
                if self.world == 1 or not is_comm_failure(error):
                    raise
                raise RankStalled.of(
                    error, self.rank, self.config.comm_timeout, self.config.out_dir
                ) from None

    def _fit(self, stop: StopFlag) -> TrainReport:
        cfg, state = self.config, self.state
        torch.manual_seed(cfg.seed + self.rank)
        if cfg.resume:
            self.resume()
        start_step = state.step
        _peak_memory.reset_peaks(self.strategy.devices)  # the report's peak is this call's
        self.model.train()
        # A signal during start-up (caught by the command line's flag) stops before step one.
        signum: int | None = self.strategy.agree_stop(state.step, starting=True)
        if self.world > 1 and cfg.comm_timeout is not None:
            # Every rank is here (start-up skew is over): a rank silent for longer ends the run.
            set_comm_timeout(cfg.comm_timeout)
        note_training()  # the launcher may now wait for a stop as long as the timeout says
        # What ran before this call (a resumed checkpoint's counts) stays out of its report.
        bar = self.recorder.start()
        prepared = Prefetcher(
            lambda: self._prepare(state.epoch, state.batch_in_epoch), depth=self._prefetch
        )
        self.callbacks.call("on_fit_start", self)
        try:
            with prepared as ahead, bar:
                batches = ahead.items()
                while state.step < cfg.steps and signum is None:
                    item = next(batches)
                    state.epoch, state.batch_in_epoch = item.epoch, item.index + 1
                    result = train_step(self, item.batch, item.layout, item.counted)
                    if self.balancer.active and self.balancer.step():  # every rank alike
                        self.recorder.resplit()  # the new split went to the sampler
                    state.step += 1
                    self.recorder.step_done(result, item.layout)  # record, log, callbacks
                    if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0:
                        self.save()
                    # Between steps, on every rank alike: the step is whole, the ranks agree.
                    signum = self.strategy.agree_stop(state.step, result.votes)
        except KeyboardInterrupt as error:
            # Not from a signal while the flag is active (those only set it): raised by the
            # program itself or outside the main thread. One process stops with SIGINT (the
            # step it cut is not counted); across ranks it propagates.
            signum = self.strategy.agree_stop(state.step, interrupted=error)
        elapsed = self.recorder.elapsed()
        signum = late_signal(signum, state.step >= cfg.steps, self.rank)  # finished anyway
        if state.step != self._saved_step:  # never a second save of the same step
            self.save()
        report = self.recorder.report(elapsed, signum)
        # The same files evendp train writes; a resumed run that had nothing left to do
        # leaves the report it finished with untouched.
        if cfg.out_dir is not None and self.rank == 0 and state.step != start_step:
            write_report(report, cfg.out_dir)
        self.callbacks.call("on_fit_end", self, report)
        return report
