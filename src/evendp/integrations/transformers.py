"""``UnevenTrainer``: a Hugging Face ``Trainer`` whose ranks each take their own batch size.

One process per device (``evendp launch``, ``torchrun``). Through the Trainer's overridable
methods only: this rank's loader, the global batch's loss (a token loss by the Trainer's own
``num_items_in_batch`` path, any other weighted by ``count_fn``), the true total batch, and
one process's evaluation (:mod:`._hf_eval`); docs/integrations.md says what is refused.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import transformers
from accelerate.utils import send_to_device
from torch import nn
from torch.utils.data import DataLoader

import evendp

from ._hf_eval import EvalMeans, EvalPieces
from ._rows import RowsGather, gather_rows, no_rows
from ._speed import Unbalanced, batch_rows, resizable, resplitting, time_forward
from ._teardown import release_at_exit
from .accelerate import uneven_dataloader

__all__ = ["UnevenTrainer", "count_labels", "count_rows"]

# Loader settings copied from the Trainer's own training loader (see get_train_dataloader).
_LOADER_SETTINGS = (
    "num_workers",
    "pin_memory",
    "worker_init_fn",
    "persistent_workers",
    "prefetch_factor",
    "multiprocessing_context",
)


def count_rows(inputs: Mapping[str, Any]) -> int:
    """Rows in a batch: the length of ``labels``, else of the first tensor; 0 for a stand-in.

    >>> count_rows({"input_ids": torch.zeros(3, 5), "labels": torch.zeros(3)})
    3
    """
    if evendp.is_stand_in(inputs):
        return 0
    return batch_rows(inputs, "pass count_fn=... to UnevenTrainer")


def count_labels(inputs: Mapping[str, Any], shift: bool = False) -> int | torch.Tensor:
    """The labels a mean loss averages over: those not ``-100`` (``shift``: from position 1),
    as a cross-entropy mean is; without ``labels``, :func:`count_rows` (0 for a stand-in).

    >>> count_labels({"labels": torch.tensor([[5, 6, -100], [7, -100, -100]])})
    tensor(3)
    >>> count_labels({"labels": torch.tensor([2, 0, 1])})
    tensor(3)
    """
    labels = inputs.get("labels")
    if evendp.is_stand_in(inputs) or not isinstance(labels, torch.Tensor) or labels.dim() == 0:
        return count_rows(inputs)
    counted = labels[..., 1:] if shift and labels.dim() > 1 else labels
    return counted.ne(-100).sum()


def _uncounted(batch: Any) -> Any:
    """A stand-in batch as the Trainer's token count must see it: every label ignored."""
    if not (evendp.is_stand_in(batch) and isinstance(batch, Mapping)):
        return batch
    ignored = {
        k: torch.full_like(v.as_subclass(torch.Tensor), -100)
        for k in ("labels", "shift_labels")
        if isinstance(v := batch.get(k), torch.Tensor)
    }
    return {**batch, **ignored}


def _validate_args(args: transformers.TrainingArguments) -> None:
    """Refuse the Trainer settings evendp cannot keep exact, naming the fix."""
    if args.auto_find_batch_size:
        raise evendp.EvendpError(
            "auto_find_batch_size=True is not supported by UnevenTrainer: it changes one batch "
            "size for all ranks after an out-of-memory error. Set auto_find_batch_size=False "
            "and pass batch_sizes=[...] (e.g. from `evendp plan --mode ddp`)"
        )
    if args.n_gpu > 1:
        raise evendp.EvendpError(
            f"this process drives {args.n_gpu} GPUs (the Trainer would wrap the model in "
            "nn.DataParallel); start one process per GPU with `evendp launch` or torchrun"
        )
    if not args.average_tokens_across_devices:
        raise evendp.EvendpError(
            "average_tokens_across_devices=False weights every rank's tokens by its own count; "
            "with uneven batch sizes that biases the gradient. Set it to True (the default)"
        )
    if args.train_sampling_strategy in ("group_by_length", "batch_rebalance"):
        raise evendp.EvendpError(
            f"train_sampling_strategy={args.train_sampling_strategy!r} chooses its own batches; "
            "UnevenTrainer supports 'random' and 'sequential'. For what group_by_length does, "
            "exactly: UnevenTrainer(costs=lambda s: len(s['input_ids'])) sends each step's "
            "samples to ranks by length"
        )


#: Methods UnevenTrainer overrides: a subclass of it must call ``super()`` in its own.
_EXTENDED = (
    "get_train_dataloader",
    "get_batch_samples",
    "get_total_train_batch_size",
    "compute_loss",
    "training_step",
    "train",
    "log",
)
#: What a Trainer subclass composed after UnevenTrainer must leave to the Trainer: the loader
#: (UnevenTrainer builds its own, so another one would be bypassed) and the count of items.
_REPLACED = ("get_train_dataloader", "get_batch_samples", "_get_num_items_in_batch")


def _calls_super(cls: type, name: str) -> bool:
    """Whether ``cls.name`` calls ``super().name`` (read from its code: no call is made)."""
    code = getattr(inspect.unwrap(vars(cls)[name]), "__code__", None)
    return code is not None and "super" in code.co_names and name in code.co_names


def _validate_composition(cls: type) -> None:
    """Refuse a Trainer subclass that overrides what UnevenTrainer relies on, naming it.

    ``class X(UnevenTrainer, SFTTrainer)`` works (UnevenTrainer's methods reach SFTTrainer's
    through ``super()``); a Trainer subclass before UnevenTrainer, one after it with its own
    loader or item count, or an override that never calls ``super()`` is refused.
    """
    mro = cls.__mro__
    here = mro.index(UnevenTrainer)
    for owner in mro[:here]:
        if not issubclass(owner, UnevenTrainer):
            raise evendp.EvendpError(
                f"{cls.__name__} puts {owner.__name__} before UnevenTrainer, so its methods "
                f"hide evendp's; write class {cls.__name__}(UnevenTrainer, {owner.__name__})"
            )
        for name in _EXTENDED:
            if name in vars(owner) and not _calls_super(owner, name):
                raise evendp.EvendpError(
                    f"{owner.__name__}.{name} does not call super().{name}(...), which "
                    f"UnevenTrainer needs for uneven batches; call it, or subclass "
                    "transformers.Trainer instead"
                )
    for owner in mro[here + 1 : mro.index(transformers.Trainer)]:
        for name in _REPLACED:
            if name in vars(owner):
                raise evendp.EvendpError(
                    f"{owner.__name__} overrides {name}, which UnevenTrainer replaces (each "
                    "rank's own batches and their count); it cannot be composed with "
                    "UnevenTrainer"
                )
        if "training_step" in vars(owner) and not _calls_super(owner, "training_step"):
            raise evendp.EvendpError(
                f"{owner.__name__}.training_step does not call super().training_step(...): "
                "the Trainer's loss scaling, which UnevenTrainer's exact gradient relies on, "
                "would not run; it cannot be composed with UnevenTrainer"
            )


def _validate_eval_composition(cls: type) -> None:
    """Refuse a ``prediction_step`` before UnevenTrainer's that never reaches it (each
    batch's loss and a stand-in's rows would stay as each rank computed them)."""
    for owner in cls.__mro__[: cls.__mro__.index(UnevenTrainer)]:
        if "prediction_step" in vars(owner) and not _calls_super(owner, "prediction_step"):
            raise evendp.EvendpError(
                f"{owner.__name__}.prediction_step does not call super().prediction_step(...)"
                ", which UnevenTrainer's exact evaluation needs (each batch's loss over all "
                "ranks, each row once); call it"
            )


class _StepBalancer(transformers.TrainerCallback):
    """Times each rank's optimizer step beside its forward passes, and at the end of every
    optimizer step, on every rank: maybe a new split (speed)."""

    def __init__(self, trainer: UnevenTrainer) -> None:
        self.trainer = trainer
        self._timed = contextlib.ExitStack()

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # The gradients were reduced in backward: the update is this rank's own compute (a
        # CPU-offloaded optimizer, an older card's memory bandwidth), so it counts.
        self._timed.enter_context(self.trainer.balancer.measure(0))

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._timed.close()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.balancer.step()


class UnevenTrainer(transformers.Trainer):
    """``transformers.Trainer`` with ``batch_sizes[r]`` samples per forward pass on rank ``r``.

    ``batch_sizes`` defaults to ``EVENDP_BATCH_SIZES`` (``evendp launch``), else
    ``per_device_train_batch_size`` on every rank; ``"auto"`` splits
    ``per_device_train_batch_size * world_size`` by each rank's memory (``memory=``,
    ``EVENDP_MEMORY``, else the GPU's free memory), planned for this model on one training
    sample. ``count_fn(inputs)``: the items a non-token loss is a mean over (default
    :func:`count_labels`, shifted for a causal LM). ``balance="speed"`` moves samples from
    slow ranks to fast ones at optimizer steps (:class:`evendp.SpeedBalancer`); ``costs``
    (each sample's length, or a function of a dataset item) sends each step's samples to
    ranks by padded length (``group_by_length`` with the exact gradient). Each step's
    samples and gradient stay one process's; everything else is the Trainer's.

    >>> import tempfile
    >>> from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
    >>> model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=8, n_embd=8, n_layer=1,
    ...                                    n_head=2))
    >>> args = TrainingArguments(tempfile.mkdtemp(), report_to="none", use_cpu=True)
    >>> trainer = UnevenTrainer(model, args, batch_sizes=[3])
    >>> trainer.batch_sizes, trainer.get_total_train_batch_size(args)
    ([3], 3)
    >>> UnevenTrainer(model, TrainingArguments(tempfile.mkdtemp(), report_to="none",
    ...               use_cpu=True, auto_find_batch_size=True))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: auto_find_batch_size=True is not supported by UnevenTrainer: ...
    """

    # compute_loss returns the loss already normalized over the whole optimizer step.
    loss_is_scaled_for_ga = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        # Checked where the class is written (class X(UnevenTrainer, SFTTrainer)), before any
        # other Trainer's __init__ could fail first on something unrelated.
        super().__init_subclass__(**kwargs)
        _validate_composition(cls)

    def __init__(
        self,
        *args: Any,
        batch_sizes: Sequence[int] | str | None = None,
        count_fn: Callable[[Mapping[str, Any]], int | torch.Tensor] | None = None,
        balance: str | None = None,
        costs: Sequence[float] | Callable[[Any], float] | None = None,
        memory: str | Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        # Checked by TrainConfig: one list of balance modes, one meaning of a batch_sizes text.
        config = evendp.TrainConfig(
            balance="none" if balance is None else balance,  # type: ignore[arg-type]
            batch_sizes=batch_sizes if isinstance(batch_sizes, str) else None,  # type: ignore[arg-type]
        )
        self.balance = config.balance
        self.costs = costs
        self.balancer: evendp.SpeedBalancer | Unbalanced = Unbalanced()
        # Speed balance: forwards timed by hooks (the current balancer's, rebuilt with each
        # training loader), a new split at each optimizer step's end.
        if self.model is not None:  # model_init: no model yet, nothing to time
            time_forward(self.model, lambda rows: self.balancer.measure(rows))
        self.add_callback(_StepBalancer(self))
        _validate_args(self.args)
        # Subclasses gather per-sample metrics (DPO's rewards): rows differ by rank now.
        self.accelerator.gather = RowsGather(self.accelerator)
        world = max(1, self.args.world_size)
        self._caps: list[int] | None = None  # per-rank memory caps, when planned
        if isinstance(batch_sizes, str):  # "auto": TrainConfig refused any other text
            self.batch_sizes, self._caps = self._auto_sizes(memory)
        else:  # given sizes are checked (one per rank), else EVENDP_BATCH_SIZES or an even split
            even = [self.args.per_device_train_batch_size] * world
            self.batch_sizes = evendp.batch_sizes_from_env(
                world,
                default=even if batch_sizes is None else batch_sizes,
                environ=None if batch_sizes is None else {},
            )
        self.count_fn = self._count_labels if count_fn is None else count_fn
        # The current optimizer step's item count over all ranks (non-token losses only).
        self._step_count: torch.Tensor | None = None
        # Whether a forward taking **kwargs really uses num_items_in_batch: tried at step 1,
        # unless the user (or the model class itself) said so.
        model = self.accelerator.unwrap_model(self.model)
        self._probe_pending = self.model_accepts_loss_kwargs and not any(
            "accepts_loss_kwargs" in vars(owner) for owner in (model, *type(model).__mro__)
        )
        self._loss_sum = torch.zeros((), device=self.args.device)  # this rank's, this train()
        self._steps = 0  # optimizer steps of this train() call
        self._eval_means: EvalMeans | None = None  # while an exact evaluation runs

    def _auto_sizes(self, memory: str | Sequence[Any] | None) -> tuple[list[int], list[int]]:
        """``batch_sizes="auto"``: ``per_device_train_batch_size * world`` split by each
        rank's memory, planned for this model on one collated training sample."""
        if self.model is None or self.train_dataset is None:
            raise evendp.EvendpError(
                "batch_sizes='auto' plans the model's step on a training sample; pass model= "
                "and train_dataset= (not model_init)"
            )
        dataset = self.train_dataset
        global_batch = self.args.per_device_train_batch_size * max(1, self.args.world_size)
        return evendp.planned_rank_sizes(
            self.model, lambda: self.data_collator([dataset[0]]), global_batch, memory=memory
        )

    def get_train_dataloader(self) -> DataLoader:
        """This rank's batches of ``batch_sizes[rank]`` samples, prepared by the accelerator;
        the Trainer's own loader built first for what it derives (unused columns, workers)."""
        base = super().get_train_dataloader()
        settings = {key: getattr(base, key) for key in _LOADER_SETTINGS}
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        loader = uneven_dataloader(
            self.accelerator,
            base.dataset,
            self.batch_sizes,
            collate_fn=base.collate_fn,
            shuffle=self.args.train_sampling_strategy != "sequential",
            seed=seed,
            drop_last=self.args.dataloader_drop_last,
            costs=self.costs,
            stand_in=True,  # an empty share: one real sample, weight 0 (compute_loss)
            **settings,
        )
        # Speed moves samples in the sampler training iterates, where a new split is decided.
        speed = self.balance == "speed" and self.args.world_size > 1  # one process: no ranks
        self.balancer = resplitting(resizable(loader), self._caps) if speed else Unbalanced()
        return loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """This rank's rows of each evaluation batch (see :mod:`._hf_eval`)."""
        return self._eval_loader(super().get_eval_dataloader(eval_dataset))

    def get_test_dataloader(self, test_dataset: Any) -> DataLoader:
        """As :meth:`get_eval_dataloader`, for ``predict``."""
        return self._eval_loader(super().get_test_dataloader(test_dataset))

    def _eval_loader(self, base: DataLoader) -> DataLoader:
        """``base``'s dataset (the Trainer's: unused columns removed) in one process's batches
        of ``eval_batch_size`` rows, each split like training; without a length, ``base``."""
        if not hasattr(base.dataset, "__len__"):
            return base
        if self.args.batch_eval_metrics:
            raise evendp.EvendpError(
                "batch_eval_metrics=True asks compute_metrics for each batch on its own, "
                "which UnevenTrainer's exact evaluation (batches split over the ranks) does "
                "not give; set batch_eval_metrics=False"
            )
        pieces = EvalPieces(
            len(base.dataset), self.args.eval_batch_size, self.batch_sizes,
            self.args.process_index,
        )  # fmt: skip
        settings = {key: getattr(base, key) for key in _LOADER_SETTINGS}
        settings["persistent_workers"] = False  # a new loader for each evaluation
        return DataLoader(
            base.dataset,
            batch_sampler=pieces,
            collate_fn=evendp.EmptySafeCollate(base.dataset, base.collate_fn, stand_in=True),
            **settings,
        )

    def evaluation_loop(
        self,
        dataloader: DataLoader,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> Any:
        """The Trainer's loop over an exact evaluation loader: rows gathered each once, in
        dataset order; ``<prefix>_loss`` the mean of the batches' losses over all ranks,
        weighted as the same loop weighs them in one process."""
        options: dict[str, Any] = {
            "prediction_loss_only": prediction_loss_only, "ignore_keys": ignore_keys,
            "metric_key_prefix": metric_key_prefix,
        }  # fmt: skip
        pieces = getattr(dataloader, "batch_sampler", None)
        if not isinstance(pieces, EvalPieces):
            return super().evaluation_loop(dataloader, description, **options)
        _validate_eval_composition(type(self))
        if self._probe_pending and len(pieces):  # whether the loss uses the count, as in training
            self._probe_loss_kwargs([next(iter(dataloader))])
        # One process's loop repeats each batch's loss eval_batch_size times; gather_for_metrics
        # (the Trainer's) cuts a short last batch's to its rows, gather (Seq2SeqTrainer's
        # evaluate and predict set it) keeps them: that batch then weighs as a full one.
        function = getattr(self, "gather_function", None)
        if isinstance(function, functools.partial):  # use_gather_object=, at construction
            function = function.func
        by_rows = bool(function == self.accelerator.gather_for_metrics)  # the Trainer's
        self._eval_means = EvalMeans(pieces, by_rows=by_rows)
        self.gather_function = functools.partial(gather_rows, self.accelerator)
        try:
            output = super().evaluation_loop(dataloader, description, **options)
        finally:
            self.gather_function = self.accelerator.gather_for_metrics
            means, self._eval_means = self._eval_means, None
        metrics = output.metrics if output.metrics is not None else {}
        if f"{metric_key_prefix}_loss" in metrics and means is not None and means.means:
            metrics[f"{metric_key_prefix}_loss"] = means.value(self.args.logging_nan_inf_filter)
        return output

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor | None, Any, Any]:
        """The Trainer's step on this rank's piece; its loss made the whole batch's (the
        same on every rank), and a stand-in's outputs emptied."""
        means = self._eval_means
        if means is None:
            return super().prediction_step(
                model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **kwargs
            )
        # As in training: a loss the Trainer divides by the items counted over the ranks (a
        # stand-in's labels read as ignored) is this rank's part of the batch's loss; any
        # other is the mean over this rank's count_fn items.
        summed = "labels" in inputs and self._token_path(1)
        count = 0 if summed else self.count_fn(inputs)  # before labels pop
        loss, logits, labels = super().prediction_step(
            model, _uncounted(inputs) if summed else inputs, prediction_loss_only,
            ignore_keys=ignore_keys, **kwargs,
        )  # fmt: skip
        if loss is not None and summed:  # the Trainer multiplied it by the processes for DDP
            loss = means.add(loss / self.accelerator.num_processes, 0, summed=True)
        elif loss is not None:  # the same on every rank: the batches' keys are the same
            loss = means.add(loss, count)
        if evendp.is_stand_in(inputs):
            logits, labels = no_rows(logits), no_rows(labels)
        return loss, logits, labels

    def get_total_train_batch_size(self, args: transformers.TrainingArguments) -> int:
        """Samples per optimizer step over all ranks: ``sum(batch_sizes) * accumulation``."""
        return sum(self.batch_sizes) * args.gradient_accumulation_steps

    def _token_path(self, num_items_in_batch: object) -> bool:
        """Whether the Trainer's own num_items_in_batch normalization applies to this loss."""
        return num_items_in_batch is not None and (
            bool(self.model_accepts_loss_kwargs) or self.compute_loss_func is not None
        )

    def _count_labels(self, inputs: Mapping[str, Any]) -> int | torch.Tensor:
        # A causal LM's mean skips each row's first label: count as its loss does (the model
        # read now: model_init may replace it).
        model = self.accelerator.unwrap_model(self.model)
        return count_labels(inputs, shift=bool(evendp.label_shift(model)))

    def get_batch_samples(
        self, epoch_iterator: Any, num_batches: int, device: torch.device
    ) -> tuple[list[Any], torch.Tensor | int | None]:
        """The Trainer's micro-batches of one step; also their item count over all ranks (a
        stand-in's labels read as ignored)."""
        batches = list(itertools.islice(epoch_iterator, num_batches))
        if self._probe_pending and batches:  # the same on every rank: so is this collective
            self._probe_loss_kwargs(batches)
        views = iter([_uncounted(batch) for batch in batches])
        _, num_items = super().get_batch_samples(views, num_batches, device)
        self._step_count = None
        self._steps += 1
        if not self._token_path(num_items):
            local = sum((self._checked_count(batch) for batch in batches), start=0)
            self._step_count = self._global_count(local)
        return batches, num_items

    def _checked_count(self, inputs: Mapping[str, Any]) -> int | torch.Tensor:
        """``count_fn(inputs)``, a whole number >= 0; a tensor's value read at the first step
        only (a read waits for the GPU, and the HF Trainer reads none at a steady step)."""
        count = self.count_fn(inputs)
        if isinstance(count, torch.Tensor):
            ok = count.numel() == 1 and count.dtype != torch.bool and not count.is_complex()
            value = float(count) if ok and self._steps <= 1 else 0.0
        else:
            ok = isinstance(count, numbers.Real) and not isinstance(count, bool)
            value = float(count) if ok else 0.0
        if not (ok and math.isfinite(value) and value >= 0 and value.is_integer()):
            raise evendp.EvendpError(
                f"count_fn(inputs) must be a whole number >= 0 (items counted), got {count!r}"
            )
        return count

    def _global_count(self, local: int | torch.Tensor) -> torch.Tensor:
        """The step's count summed over ranks on the loss's device: one all-reduce, no copy
        to the host (``global_count`` would put it on the CPU in one process)."""
        device = self.args.device
        count = torch.as_tensor(local, device=device).detach().reshape(())
        count = count.to(torch.float64 if count.is_floating_point() else torch.int64)
        if max(1, self.args.world_size) > 1:
            dist.all_reduce(count)  # on args.device: the rank's GPU under NCCL, else gloo's
        return count

    def _probe_loss_kwargs(self, batches: list[Any]) -> None:
        """Whether the model's loss uses ``num_items_in_batch``, agreed by every rank (no grad).

        Many losses whose ``forward`` takes ``**kwargs`` ignore it (a per-batch mean): twice
        the count halves a loss that uses it; one that ignores it is weighted by its labels;
        anything else stops the run. Agreed (one all-reduce) because it decides the step's
        collectives; a rank with nothing counted abstains.
        """
        if self.compute_loss_func is not None or not any("labels" in b for b in batches):
            self._probe_pending = False  # the same on every rank: the collator's keys
            return
        # This rank's verdict: its first micro-batch whose loss counted something decides.
        self._probe_note = "no counted label on this rank"
        mine = (self._probe_batch(b) for b in batches if _has_labels(b))
        verdict = next((v for v in mine if v != "inconclusive"), "inconclusive")
        verdicts = torch.zeros(len(_VERDICTS), dtype=torch.int64, device=self.args.device)
        verdicts[_VERDICTS.index(verdict)] = 1
        if max(1, self.args.world_size) > 1:
            dist.all_reduce(verdicts)  # (uses, ignores, odd, inconclusive) over ranks
        uses, ignores, odd, _ = verdicts.tolist()
        if odd or (uses and ignores):
            model = self.accelerator.unwrap_model(self.model)
            raise evendp.EvendpError(
                f"{type(model).__name__}'s loss takes num_items_in_batch but is neither a sum "
                f"over it nor independent of it ({self._probe_note}); set "
                "model.accepts_loss_kwargs = True if its loss is a sum divided by "
                "num_items_in_batch, or False if it is a per-batch mean (weighted by count_fn)"
            )
        if uses or ignores:
            self._probe_pending = False
            if ignores:
                self.model_accepts_loss_kwargs = False  # a per-batch mean: weighted by labels

    def _probe_batch(self, batch: Mapping[str, Any]) -> str:
        """One batch's verdict: the loss with counts 1 and 2 (a stand-in too: a real sample)."""
        model = self.accelerator.unwrap_model(self.model)
        device = self.args.device
        inputs = send_to_device(dict(batch), device)
        was_training = model.training
        # No dropout: the two passes differ only in the count; and no timing (eval mode).
        model.eval()
        try:
            with torch.no_grad(), self.compute_loss_context_manager():
                outputs = [
                    model(**inputs, num_items_in_batch=torch.tensor(n, device=device))
                    for n in (1.0, 2.0)
                ]
        finally:
            model.train(was_training)
        # A ModelOutput's or a dict's "loss", else the first output.
        one, two = (float(out["loss"] if isinstance(out, Mapping) else out[0]) for out in outputs)
        self._probe_note = f"count 1 gave {one:.6g}, count 2 gave {two:.6g}"
        # Nothing counted after all (a causal shift of a 1-token row): a sum gives 0, a mean NaN.
        if not (math.isfinite(one) and math.isfinite(two)) or one == 0.0:
            return "inconclusive"
        if abs(one - two) <= 1e-6 * abs(one):
            return "ignores"
        return "odd" if abs(one - 2 * two) > 1e-4 * abs(one) else "uses"

    def compute_loss(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, Any]:
        """The Trainer's loss; a non-token training loss rescaled to the global-batch mean; a
        stand-in batch (an empty share) weighs exactly 0."""
        step_count = self._step_count if model.training else None
        stand_in = evendp.is_stand_in(inputs)
        count = self.count_fn(inputs) if step_count is not None else 0  # before labels pop
        # return_outputs as asked: some subclasses (TRL's) run an extra forward for outputs.
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss: torch.Tensor = result[0] if isinstance(result, tuple) else result
        if step_count is not None:
            # ddp_loss's weighting, world / the step's count, with a count already checked:
            # ddp_loss would read its value again, on the host, at every step. A step that
            # counted nothing anywhere weighs every share by its count, 0.
            mean = loss if loss.dtype in (torch.float32, torch.float64) else loss.float()
            world = max(1, self.args.world_size)
            total = step_count.to(device=mean.device, dtype=torch.float64).clamp(min=1)
            loss = evendp.share_loss(mean, count, (world / total).to(mean.dtype))
        elif stand_in and model.training:
            loss = evendp.share_loss(loss, 0, stand_in=True)
        return (loss, result[1]) if isinstance(result, tuple) else loss

    def training_step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """The Trainer's step; its loss also summed here for the global ``train_loss``."""
        loss = super().training_step(*args, **kwargs)
        self._loss_sum = self._loss_sum + loss.detach().to(self._loss_sum.device)
        return loss

    def train(self, *args: Any, **kwargs: Any) -> transformers.trainer_utils.TrainOutput:
        """The Trainer's ``train``; its ``train_loss`` is the global batch's, on every rank.
        Afterwards no DDP wrapper holds the process group (see ``_teardown``)."""
        self._loss_sum = torch.zeros((), device=self.args.device)
        self._steps = 0
        output = super().train(*args, **kwargs)
        release_at_exit(self)
        loss = output.metrics.get("train_loss", output.training_loss)
        return transformers.trainer_utils.TrainOutput(output.global_step, loss, output.metrics)

    def log(self, logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
        """The Trainer's ``log``; the final ``train_loss`` made global first (all ranks log it):
        the mean of the ranks' sums, each rank's loss being its part of the global one."""
        if "train_loss" in logs and self._steps:
            total = self.accelerator.gather(self._loss_sum.reshape(1)).mean()
            logs["train_loss"] = float(total) / self._steps
        super().log(logs, *args, **kwargs)


#: The probe's possible verdicts, in the order of the all-reduced tally.
_VERDICTS = ("uses", "ignores", "odd", "inconclusive")


def _has_labels(batch: Mapping[str, Any]) -> bool:
    """Whether a batch has a label that is not ``-100`` (a stand-in's real sample too)."""
    labels = batch.get("labels")
    return isinstance(labels, torch.Tensor) and bool(labels.ne(-100).any())
