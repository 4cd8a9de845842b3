"""Single-process balanced data parallelism: ``BalancedDataParallel`` and its loss helpers.

One step, for a global batch of N samples and devices d_0..d_{k-1}:

1. sizes n_i = largest-remainder split of N by the per-device weights (zeros allowed);
2. scatter: each active device gets its n_i consecutive samples (differentiable copies);
3. replicate: a replica per active device whose parameters are differentiable copies;
4. parallel apply: every replica runs forward in its own thread;
5. gather: outputs are concatenated; a scalar (a mean loss over c_i counted items: samples by
   default, or what ``count_fn`` says, e.g. non-ignored tokens) is combined with weights
   c_i / sum_j c_j, leaving out shares that count no item.

Step 5's weighting is what makes the loss, and so the gradient, equal to a single device's on
the whole batch, however uneven the split.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import nn

from .._core._batchnorm import warn_if_batchnorm_split_unevenly
from .._core._counting import auto_count, holds_ignored, uncounted_warning
from .._core._deprecation import UNSET, renamed_argument, warn_renamed
from .._core._errors import EvendpError
from .._core._exact import combine_means
from .._core._oom_errors import is_oom_error, replica_of, tag_device_index
from .._core._split import split_sizes, validate_weights
from .._core._validate import is_int, validate_int
from ._replicate import parallel_apply, replicate
from ._scatter import gather_outputs, map_tensors, row_count, row_count_and_devices, scatter

__all__ = ["BalancedDataParallel", "ParallelCriterion", "Scattered", "gather"]

DeviceLike = int | str | torch.device
Weights = Sequence[float] | Literal["auto"] | None
#: What a count function may return: a number of items, as an int or a 0-dim tensor.
Count = int | float | torch.Tensor


# PyTorch's message when BatchNorm in training mode gets one value per channel.
_NAME = "BalancedDataParallel"
_BATCHNORM_ONE_VALUE = "Expected more than 1 value per channel when training"


@dataclass(frozen=True)
class Scattered:
    """Per-device outputs of ``BalancedDataParallel(..., gather_output=False)`` and their split.

    ``outputs[i]`` lives on ``devices[i]`` and covers ``sizes[i]`` consecutive samples of the
    batch; ``counts[i]`` is the number of items a scalar in it is a mean over (``None``: the
    samples). Hand it to :class:`ParallelCriterion`, or to :func:`gather` for the full output.
    """

    outputs: list[Any]
    sizes: list[int]
    devices: list[torch.device]
    dim: int
    output_device: torch.device
    counts: list[float] | None = None

    @property
    def batch_size(self) -> int:
        """The number of samples across all devices (N)."""
        return sum(self.sizes)


def gather(scattered: Scattered) -> Any:
    """The full output on ``scattered.output_device``: per-device outputs joined along ``dim``.

    >>> model = BalancedDataParallel(nn.Linear(3, 2), ["cpu", "cpu"], gather_output=False)
    >>> parts = model(torch.randn(5, 3))
    >>> parts.sizes, gather(parts).shape
    ([3, 2], torch.Size([5, 2]))
    """
    _validate_scattered(scattered)
    return gather_outputs(
        scattered.outputs,
        scattered.sizes,
        scattered.output_device,
        scattered.dim,
        scattered.counts,
    )


class BalancedDataParallel(nn.Module):
    """``nn.DataParallel`` with per-device batch shares and an exact, count-weighted combine.

    Args:
        module: the model; it must already sit on ``device_ids[0]``.
        device_ids: devices as ints (CUDA indices), strings or ``torch.device``. Repeats are
            *virtual* devices run in threads: ``["cpu", "cpu", "cpu"]`` runs the whole path
            with no GPU. Default: every visible CUDA device, else ``["cpu"]``.
        output_device: where outputs are gathered (default ``device_ids[0]``).
        dim: the batch dimension of inputs and outputs.
        weights: ``None`` for an even split; one non-negative weight per device,
            normalized for every batch by largest remainder (a zero-weight device gets no
            replica and no memory); or ``"auto"``: on the first batch, plan the split that
            fits each CUDA device's live free memory (:func:`evendp.plan`; equal weights on
            virtual CPU devices, which have no memory to read).
        gather_output: ``False`` returns a :class:`Scattered` instead of gathered outputs.
        count_fn: ``count_fn(*inputs, **kwargs)`` is called on each replica's share of the
            inputs (the signature of ``forward``) and returns the number of items that
            replica's scalar output is a mean over, as an int or a 0-dim tensor, e.g.
            :func:`evendp.count_tokens` (``count_tokens(shift=True)`` for a causal LM's
            ``labels``). Default: a Hugging Face model whose class names its task
            (``GPT2LMHeadModel``, ``*ForCausalLM``, ``*ForMaskedLM``, ...) called with
            ``labels=`` counts its non-ignored labels, shifted where its loss shifts them;
            anything else counts samples, and warns once when it gathers a scalar output of
            inputs holding ``-100`` labels (docs/exactness.md).
        chunk_sizes: deprecated alias of ``weights``.
        gather: deprecated alias of ``gather_output``.

    A replica that returns a floating scalar (a mean loss computed inside ``forward``) is
    combined as ``sum_i c_i * loss_i / sum_i c_i`` with ``c_i`` its count: the same value,
    and so the same gradient, as one device on the whole batch. A share that counts no item
    (its mean is NaN) is left out, never multiplied by 0. (A per-device *sum* would be
    averaged the same way: return a mean, or use ``gather_output=False`` with
    ``ParallelCriterion(..., reduction="sum")``.)

    An out-of-memory error raised in a replica's forward (``torch.OutOfMemoryError``, or a
    library's allocation failure) propagates unchanged, with the
    attribute ``evendp_device_index`` naming the entry of ``device_ids`` that ran out.

    Not exact by construction: BatchNorm in training mode normalizes each share with its own
    statistics (a warning at wrap time says so when the split is uneven), and dropout draws
    different masks than one device would (docs/exactness.md).

    >>> torch.manual_seed(0) and None
    >>> net = nn.Linear(4, 1)
    >>> model = BalancedDataParallel(net, ["cpu", "cpu", "cpu"], weights=[2, 1, 0])
    >>> x = torch.randn(6, 4)
    >>> model(x).shape, model.last_sizes
    (torch.Size([6, 1]), [4, 2, 0])
    >>> torch.allclose(model(x), net(x))
    True

    A loss averaged over masked items (tokens, pixels) is exact with ``count_fn``:

    >>> class MaskedMSE(nn.Module):
    ...     def __init__(self) -> None:
    ...         super().__init__()
    ...         self.net = nn.Linear(4, 1)
    ...     def forward(self, x, y, mask):  # the mean over unmasked samples only
    ...         return ((self.net(x)[:, 0] - y) ** 2 * mask).sum() / mask.sum()
    >>> mse = MaskedMSE()
    >>> y, mask = torch.randn(6), torch.tensor([1.0, 1, 1, 1, 0, 1])
    >>> model = BalancedDataParallel(mse, ["cpu"] * 3, weights=[3, 2, 1],
    ...                              count_fn=lambda x, y, mask: mask.sum())
    >>> torch.allclose(model(x, y, mask), mse(x, y, mask))
    True
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        weights: Weights = None,
        gather_output: bool = True,
        count_fn: Callable[..., Count] | None = None,
        *,
        chunk_sizes: Weights = UNSET,
        gather: bool = UNSET,
    ) -> None:
        super().__init__()
        _validate_module(module, device_ids)
        weights = renamed_argument(_NAME, "chunk_sizes", "weights", chunk_sizes, weights)
        gather_output = renamed_argument(
            _NAME, "gather", "gather_output", gather, gather_output, default=True
        )
        self.module = module
        self.device_ids = _validate_devices(device_ids)
        self.output_device = (
            self.device_ids[0] if output_device is None else _to_device(output_device)
        )
        self.dim = _validate_dim(dim)
        self.weights = weights
        self.gather_output = _validate_flag("gather_output", gather_output)
        self.count_fn = _validate_callable("count_fn", count_fn)
        # Without count_fn: the labels of a recognised Hugging Face model, else the samples
        # (checked once for ignored labels, see _check_uncounted).
        self._label_count = auto_count(module)
        self._count_checked = False
        # Exact per-device counts for the next forwards, in place of the weights' split: set
        # by fixed_sizes() (None: split by weights).
        self._sizes: list[int] | None = None
        #: The per-device sample counts of the last forward (zeros for idle devices).
        self.last_sizes: list[int] = []
        # A per-device context around each replica's forward, in its thread: see
        # set_replica_context.
        self._replica_context: Callable[[int], Any] | None = None
        _validate_placement(module.parameters(), module.buffers(), home=self.device_ids[0])
        # One parameter, looked up afresh every step, stands for the module's placement:
        # cheaper than walking all of them, and it sees a moved or replaced parameter.
        self._sentinel = _first_parameter_slot(module)
        # Both state_dict forms load: with and without the "module." prefix.
        self.register_load_state_dict_pre_hook(_add_module_prefix)

    @property
    def weights(self) -> list[float] | None:
        """Per-device weights (``None``: even; after ``"auto"``, what the planner chose on the
        first batch). Assigning validates them; assigning ``"auto"`` plans again."""
        return self._weights

    @weights.setter
    def weights(self, value: Weights) -> None:
        if isinstance(value, str):
            _validate_auto(value)
            self._auto, self._weights = True, None
        else:
            self._auto, self._weights = False, _validate_weight_list(value, len(self.device_ids))
            warn_if_batchnorm_split_unevenly(self.module, self._weights, "weights")

    @property
    def chunk_sizes(self) -> list[float] | None:
        """Deprecated alias of :attr:`weights`."""
        warn_renamed(f"{_NAME}.chunk_sizes", f"{_NAME}.weights", stacklevel=2)
        return self._weights

    @chunk_sizes.setter
    def chunk_sizes(self, value: Weights) -> None:
        # nn.Module.__setattr__ sits between the caller and this setter.
        warn_renamed(f"{_NAME}.chunk_sizes", f"{_NAME}.weights", stacklevel=3)
        self.weights = value

    @property
    def gather(self) -> bool:
        """Deprecated alias of :attr:`gather_output`."""
        warn_renamed(f"{_NAME}.gather", f"{_NAME}.gather_output", stacklevel=2)
        return self.gather_output

    @gather.setter
    def gather(self, value: bool) -> None:
        warn_renamed(f"{_NAME}.gather", f"{_NAME}.gather_output", stacklevel=3)
        self.gather_output = _validate_flag("gather_output", value)

    def set_replica_context(
        self, hook: Callable[[int], contextlib.AbstractContextManager[Any]] | None
    ) -> None:
        """Run each replica's forward inside ``hook(i)`` (``i``: its entry of ``device_ids``),
        in the replica's own thread; ``None`` removes it. E.g. virtual devices that enforce a
        memory budget (:meth:`evendp._training._budget.MemoryBudgets.attach`).

        >>> model = BalancedDataParallel(nn.Linear(2, 1), ["cpu"] * 2)
        >>> seen = []
        >>> model.set_replica_context(lambda i: contextlib.nullcontext(seen.append(i)))
        >>> _ = model(torch.randn(3, 2))
        >>> sorted(seen)
        [0, 1]
        """
        self._replica_context = _validate_callable("hook", hook)

    @property
    def replica_context(self) -> Callable[[int], contextlib.AbstractContextManager[Any]] | None:
        """The hook each replica's forward runs inside (:meth:`set_replica_context`)."""
        return self._replica_context

    def split(self, total: int) -> list[int]:
        """The per-device sample counts for a batch of ``total`` samples."""
        return split_sizes(total, self._weights or [1.0] * len(self.device_ids))

    @contextlib.contextmanager
    def fixed_sizes(self, sizes: Sequence[int]) -> Iterator[None]:
        """Run every call inside the block with exactly ``sizes[i]`` samples on device ``i``.

        ``sizes`` holds one non-negative int per entry of ``device_ids``; each call inside
        checks that they add up to its batch. On exit the weights split batches again (an
        outer ``fixed_sizes`` is restored).

        >>> model = BalancedDataParallel(nn.Linear(2, 1), ["cpu"] * 3)
        >>> with model.fixed_sizes([0, 3, 1]):
        ...     out = model(torch.randn(4, 2))
        >>> model.last_sizes, out.shape
        ([0, 3, 1], torch.Size([4, 1]))
        >>> with model.fixed_sizes([2, 2, 2]):  # doctest: +ELLIPSIS
        ...     model(torch.randn(4, 2))
        Traceback (most recent call last):
        ...
        evendp...InputError: fixed_sizes([2, 2, 2]) add up to 6, but the batch has 4 ...
        """
        checked = _validate_fixed_sizes(sizes, len(self.device_ids))
        outer = self._sizes
        self._sizes = checked
        try:
            yield
        finally:
            self._sizes = outer

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._sentinel is not None:
            owner, name = self._sentinel
            _validate_placement([owner._parameters[name]], home=self.device_ids[0])
        total, where = row_count_and_devices((inputs, kwargs), self.dim)
        if total is None:
            raise EvendpError(
                "BalancedDataParallel got no tensor with a batch dimension "
                f"(dim={self.dim}) among its inputs; pass the batch as a tensor, or call "
                "the module directly when there is nothing to split"
            )
        self.last_sizes = self._sizes_for(total, inputs, kwargs)
        active = [i for i, n in enumerate(self.last_sizes) if n > 0] or [0]
        devices = [self.device_ids[i] for i in active]
        sizes = [self.last_sizes[i] for i in active]
        if len(devices) == 1 and where <= {devices[0]}:
            # The whole batch already sits on the one device that runs it: nothing to move.
            shards = [(inputs, kwargs)]
        else:
            shards = scatter((inputs, kwargs), sizes, devices, self.dim)
        raw_counts = self._raw_counts(shards)  # before forward: nothing waits for them yet
        replicas = self._replicas(devices, include_home=active[0] == 0)
        outputs = self._run_replicas(replicas, shards, devices, active, total)
        counts = self._checked_counts(raw_counts, active, sizes)
        if not self.gather_output:
            return Scattered(outputs, sizes, devices, self.dim, self.output_device, counts)
        # Where evendp itself combines the means (not for a Scattered: its reader does).
        if self.count_fn is None and self._label_count is None and len(self.device_ids) > 1:
            self._check_uncounted(outputs[0], inputs, kwargs)
        if len(devices) == 1 and devices[0] == self.output_device and counts[0] > 0:
            return outputs[0]  # as nn.DataParallel on one device: the module's own output
        return gather_outputs(outputs, sizes, self.output_device, self.dim, counts)

    def _sizes_for(self, total: int, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> list[int]:
        if self._sizes is not None:
            _validate_fixed_total(self._sizes, total, self.dim)
            return list(self._sizes)
        if self._auto and self._weights is None:
            self._weights = self._plan_weights(inputs, kwargs)
            warn_if_batchnorm_split_unevenly(self.module, self._weights, "weights")
        return self.split(total)

    def _raw_counts(self, shards: list[Any]) -> list[Any] | None:
        count_fn = self.count_fn or self._label_count
        if count_fn is None:
            return None
        with torch.no_grad():
            return [count_fn(*args, **kwargs) for args, kwargs in shards]

    def _check_uncounted(self, output: Any, inputs: Any, kwargs: Any) -> None:
        """Once, at the first forward that returns a mean: warn when the inputs hold
        ignored labels, which a count by samples weighs wrongly (a host read, once)."""
        if self._count_checked:
            return
        scalars: list[torch.Tensor] = []
        map_tensors(output, lambda t: scalars.append(t) if t.dim() == 0 else None)
        if not any(t.is_floating_point() for t in scalars):
            return
        self._count_checked = True
        if holds_ignored((inputs, kwargs)):
            uncounted_warning("BalancedDataParallel", self.module, stacklevel=5)

    def _checked_counts(
        self, raw: list[Any] | None, active: list[int], sizes: list[int]
    ) -> list[float]:
        if raw is None:
            return [float(n) for n in sizes]
        return [
            _validate_count(value, "count_fn", f"device_ids[{i}]={self.device_ids[i]}", n)
            for value, i, n in zip(raw, active, sizes, strict=True)
        ]

    def _run_replicas(
        self,
        replicas: list[nn.Module],
        shards: list[Any],
        devices: list[torch.device],
        active: list[int],
        total: int,
    ) -> list[Any]:
        try:
            hook = self._replica_context
            contexts = None if hook is None else [hook(i) for i in active]
            return parallel_apply(replicas, shards, devices, contexts)
        except (RuntimeError, ValueError) as error:
            if is_oom_error(error):
                # Say which entry of device_ids ran out, so a caller can shrink that share only
                # (also for cuBLAS/cuDNN allocation failures, which are plain RuntimeErrors).
                tag_device_index(error, active[replica_of(error)])
                raise
            if not isinstance(error, ValueError):
                raise
            index = active[replica_of(error)]
            share = self.last_sizes[index]
            if _BATCHNORM_ONE_VALUE not in str(error) or share == total:
                raise
            raise EvendpError(
                f"device_ids[{index}]={self.device_ids[index]} got a share of {share} "
                f"sample(s) of the batch of {total} (split {self.last_sizes}), and BatchNorm "
                "in training mode needs more than one value per channel; give every active "
                "device at least 2 samples (other weights, or a larger batch), put the "
                "BatchNorm layers in eval() mode, or use GroupNorm / LayerNorm"
            ) from error

    def _plan_weights(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> list[float]:
        """``weights="auto"``: plan DP on live free memory, the first batch as the example."""
        from .._planning._plan import auto_weights  # the planner is heavy; only "auto" needs it

        if inputs and kwargs:
            raise EvendpError(
                "weights='auto' plans from the first batch, which must be passed all "
                f"positionally or all as keywords; got {len(inputs)} positional and "
                f"keywords {sorted(kwargs)}. Plan explicitly with evendp.plan(...) and pass "
                "weights=plan.split instead"
            )
        home = self.output_device
        output_index = next((i for i, d in enumerate(self.device_ids) if d == home), 0)
        example = kwargs if kwargs else inputs
        return auto_weights(
            self.module, self.device_ids, example, output_device=output_index,
            gather_output=self.gather_output, no_grad=not torch.is_grad_enabled(),
        )  # fmt: skip

    def _replicas(self, devices: list[torch.device], include_home: bool) -> list[nn.Module]:
        # The home device runs the module itself: no copies, and buffer updates persist.
        detach = not torch.is_grad_enabled()
        if include_home:
            return [self.module, *replicate(self.module, devices[1:], detach)]
        return replicate(self.module, devices, detach)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state dict: its own keys, no ``module.`` prefix."""
        return self.module.state_dict(*args, **kwargs)


class ParallelCriterion(nn.Module):
    """Compute a loss on every device from a :class:`Scattered` and combine it exactly.

    Targets are scattered with the same sizes as the outputs. ``criterion`` is any callable
    ``criterion(output, *targets, **kwargs)``: a function, a lambda, ``functools.partial`` or
    an ``nn.Module`` (copied to each device only when it has parameters or buffers).

    With ``reduction="mean"`` (the criterion returns a per-device mean) the result is
    ``sum_i c_i * loss_i / sum_i c_i``, where ``c_i = count_fn(output_i, *targets_i,
    **kwargs_i)`` is the number of items device ``i``'s mean is over. Default count: the
    samples, except for ``nn.CrossEntropyLoss`` / ``nn.NLLLoss`` with ``reduction="mean"``,
    whose own denominator is used (targets not equal to ``ignore_index``, weighted by
    ``weight``); any other criterion whose targets hold ``-100`` (ignored labels) is
    weighted by samples with a warning, once, naming ``count_fn``
    (:func:`evendp.count_tokens`). A device whose count is 0 contributes nothing (never its
    NaN). With ``reduction="sum"`` (the criterion returns a per-device sum) the result is the
    plain sum.

    Language-model logits (N, L, V) with -100 on padding, split [2, 1] over two devices:

    >>> torch.manual_seed(0) and None
    >>> lm_head = nn.Linear(8, 11)                      # hidden (N, L, 8) -> logits (N, L, 11)
    >>> model = BalancedDataParallel(lm_head, ["cpu", "cpu"], weights=[2, 1],
    ...                              gather_output=False)
    >>> hidden, labels = torch.randn(3, 5, 8), torch.randint(0, 11, (3, 5))
    >>> labels[0, 2:] = -100                            # padding: row 0 has 2 real tokens
    >>> def token_loss(logits, labels):                 # the mean over real tokens
    ...     return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
    >>> criterion = ParallelCriterion(token_loss, count_fn=lambda out, y: (y != -100).sum())
    >>> loss = criterion(model(hidden), labels)
    >>> torch.allclose(loss, token_loss(lm_head(hidden), labels))
    True
    """

    def __init__(
        self,
        criterion: Callable[..., torch.Tensor],
        reduction: Literal["mean", "sum"] = "mean",
        count_fn: Callable[..., Count] | None = None,
    ) -> None:
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise EvendpError(
                f"reduction={reduction!r} is not supported; use 'mean' when the criterion "
                "returns a per-device mean, 'sum' when it returns a per-device sum"
            )
        self.criterion = _validate_callable("criterion", criterion)
        self.reduction = reduction
        self.count_fn = _validate_callable("count_fn", count_fn)
        self._count_checked = False  # targets with ignored labels and no count: warned once
        if count_fn is not None and reduction == "sum":
            raise EvendpError(
                "count_fn weights per-device means, but reduction='sum' adds per-device sums; "
                "use reduction='mean' with count_fn, or divide the summed loss by your global "
                "count yourself"
            )

    def forward(self, scattered: Scattered, *targets: Any, **kwargs: Any) -> torch.Tensor:
        _validate_scattered(scattered)
        target_total = row_count((targets, kwargs), scattered.dim)
        if target_total is not None and target_total != scattered.batch_size:
            raise EvendpError(
                f"targets have {target_total} samples along dim={scattered.dim} but the "
                f"outputs have {scattered.batch_size} (split {scattered.sizes}); pass the "
                "targets of the same batch"
            )
        target_shards = scatter(
            (targets, kwargs), scattered.sizes, scattered.devices, scattered.dim
        )
        shards = [
            ((output, *shard_targets), shard_kwargs)
            for output, (shard_targets, shard_kwargs) in zip(
                scattered.outputs, target_shards, strict=True
            )
        ]
        count_fn = self.count_fn or _builtin_count_fn(self.criterion)
        if count_fn is None and self.reduction == "mean" and len(scattered.sizes) > 1:
            self._check_uncounted(targets, kwargs)
        with torch.no_grad():
            raw_counts = None if count_fn is None else [count_fn(*a, **kw) for a, kw in shards]
        losses = parallel_apply(self._criteria(scattered.devices), shards, scattered.devices)
        for loss in losses:
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise EvendpError(
                    f"the criterion returned {_describe(loss)} on a device; ParallelCriterion "
                    "needs a scalar per device: use reduction='mean' or 'sum' in the criterion"
                )
        if self.reduction == "sum":
            sums = [loss.to(scattered.output_device) for loss in losses]
            return torch.stack(sums).sum()
        if raw_counts is None:
            counts = [float(n) for n in scattered.sizes]
        else:
            counts = [
                _validate_count(value, "count_fn", f"device {device} (output {i})", n)
                for i, (value, device, n) in enumerate(
                    zip(raw_counts, scattered.devices, scattered.sizes, strict=True)
                )
            ]
        return combine_means(losses, counts, scattered.output_device)

    def _check_uncounted(self, targets: Any, kwargs: Any) -> None:
        """Once: warn when targets hold ignored labels that a count by samples weighs
        wrongly (a host read, once)."""
        if not self._count_checked:
            self._count_checked = True
            if holds_ignored((targets, kwargs)):
                uncounted_warning("ParallelCriterion", self.criterion, stacklevel=5)

    def _criteria(self, devices: list[torch.device]) -> list[nn.Module]:
        criterion = self.criterion
        if isinstance(criterion, nn.Module) and _has_state(criterion):
            return replicate(criterion, devices, not torch.is_grad_enabled())
        # A function, or a module with nothing to copy: the same callable on every device.
        return cast(list[nn.Module], [criterion] * len(devices))


def _has_state(module: nn.Module) -> bool:
    return any(True for _ in itertools.chain(module.parameters(), module.buffers()))


def _builtin_count_fn(criterion: Callable[..., Any]) -> Callable[..., Count] | None:
    """The denominator of a built-in criterion's mean, where it is not the samples."""
    if isinstance(criterion, (nn.CrossEntropyLoss, nn.NLLLoss)) and criterion.reduction == "mean":
        return functools.partial(_class_loss_count, criterion)
    return None


def _class_loss_count(
    criterion: nn.CrossEntropyLoss | nn.NLLLoss, output: Any, *targets: Any, **kwargs: Any
) -> Count:
    """What ``CrossEntropyLoss``/``NLLLoss`` divide by: the weight of non-ignored targets."""
    target = targets[0] if targets else kwargs.get("target")
    if not isinstance(target, torch.Tensor):
        return 1  # nothing to read: one share, one mean (the criterion will complain itself)
    if target.is_floating_point():  # class probabilities: the mean is over positions
        return target.numel() // target.shape[1] if target.dim() > 1 else 1
    valid = target != criterion.ignore_index
    weight = criterion.weight
    if weight is None:
        return valid.sum()
    return (weight.to(target.device)[target.masked_fill(~valid, 0)] * valid).sum()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def _to_device(device: DeviceLike) -> torch.device:
    if isinstance(device, bool):
        raise EvendpError(
            f"device {device!r} is not a device; pass an int, a string or torch.device"
        )
    try:
        resolved = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise EvendpError(
            f"device {device!r} is not a device; pass an int (a CUDA index), a string such as "
            "'cuda:1' or 'cpu', or a torch.device"
        ) from exc
    if resolved.type == "cuda":
        return _validate_cuda_device(resolved)
    return resolved


def _validate_cuda_device(device: torch.device) -> torch.device:
    if not torch.cuda.is_available():
        raise EvendpError(
            f"device {device} was requested but CUDA is not available here; run on virtual "
            "devices instead, e.g. device_ids=['cpu', 'cpu', 'cpu']"
        )
    index = torch.cuda.current_device() if device.index is None else device.index
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise EvendpError(
            f"device cuda:{index} does not exist: this process sees {count} CUDA device(s), "
            "numbered 0.. in CUDA_VISIBLE_DEVICES order "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use logical "
            "indices, "
            "e.g. CUDA_VISIBLE_DEVICES=2,3 makes physical GPUs 2 and 3 cuda:0 and cuda:1"
        )
    return torch.device("cuda", index)


def _validate_devices(device_ids: Sequence[DeviceLike] | None) -> list[torch.device]:
    if device_ids is None:
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]
    if isinstance(device_ids, (str, torch.device, int)) or not isinstance(device_ids, Sequence):
        raise EvendpError(
            f"device_ids must be a list of devices, got {device_ids!r}; "
            f"wrap it in a list: device_ids=[{device_ids!r}]"
        )
    devices = [_to_device(d) for d in device_ids]
    if not devices:
        raise EvendpError("device_ids is empty; pass at least one device, e.g. ['cpu']")
    return devices


def _validate_dim(dim: int) -> int:
    return int(validate_int("dim", dim, minimum=0, example="dim=0, the batch dimension"))


def _validate_auto(value: str) -> None:
    if value != "auto":
        raise EvendpError(
            f"weights={value!r} is not understood; pass None (even split), 'auto' "
            "(planned from free memory), or one non-negative weight per device"
        )


def _validate_weight_list(value: Sequence[float] | None, num_devices: int) -> list[float] | None:
    if value is None:
        return None
    return validate_weights(value, expected_len=num_devices)


def _validate_placement(*groups: Iterable[torch.Tensor | None], home: torch.device) -> None:
    for tensor in itertools.chain(*groups):
        if tensor is not None and not _same_device(tensor.device, home):
            raise EvendpError(
                f"the module's tensors must sit on device_ids[0]={home}, but one is on "
                f"{tensor.device}; call module.to({str(home)!r}) before wrapping it, or put "
                f"its device first in device_ids. Note: CUDA_VISIBLE_DEVICES renumbers GPUs "
                "(with CUDA_VISIBLE_DEVICES=2,3 physical GPU 2 is cuda:0); "
                "evendp.select_devices sets it for you before CUDA starts"
            )


def _first_parameter_slot(module: nn.Module) -> tuple[nn.Module, str] | None:
    for owner in module.modules():
        for name, param in owner._parameters.items():
            if param is not None:
                return owner, name
    return None


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type != "cuda" or a.index == b.index


def _validate_scattered(value: Any) -> None:
    if not isinstance(value, Scattered):
        raise EvendpError(
            "expected the Scattered returned by BalancedDataParallel(..., gather_output=False), "
            f"got {_describe(value)}; for an already gathered output call the criterion directly"
        )


def _validate_module(module: Any, device_ids: Any) -> None:
    if isinstance(module, nn.Module):
        return
    if isinstance(device_ids, nn.Module):
        raise EvendpError(
            f"BalancedDataParallel got {module!r} before the module: that is the old "
            "BalancedDataParallel(gpu0_bsz, model, dim=0) call. evendp takes the module first "
            "and one weight per device: BalancedDataParallel(model, device_ids, "
            f"weights=[gpu0_bsz, bsz, ...]), e.g. weights=[{module!r}, bsz, bsz] for three "
            "GPUs where GPU 0 takes fewer samples than the others"
        )
    raise EvendpError(
        f"BalancedDataParallel's first argument must be the nn.Module to wrap, got "
        f"{_describe(module)}; call BalancedDataParallel(model, device_ids, weights=[...])"
    )


def _validate_flag(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise EvendpError(f"{name} must be True or False, got {value!r}")
    return value


def _validate_callable(name: str, value: Any) -> Any:
    if value is not None and not callable(value):
        raise EvendpError(
            f"{name} must be callable (a function, a lambda, functools.partial or an "
            f"nn.Module), got {_describe(value)}"
        )
    return value


def _validate_count(value: Any, name: str, where: str, samples: int) -> float:
    """A count returned by a count function, as a float; or raise naming where it came from."""
    number: float | None = None
    if isinstance(value, torch.Tensor):
        if value.dim() == 0 and not value.is_complex() and value.dtype != torch.bool:
            number = float(value.item())
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    if number is None or not math.isfinite(number) or number < 0:
        shown = _describe(value) if isinstance(value, torch.Tensor) and value.dim() else value
        raise EvendpError(
            f"{name} returned {shown!r} for the share of {samples} sample(s) on {where}; it "
            "must return how many items that share's mean is over, a non-negative int or "
            "0-dim tensor, e.g. (labels != -100).sum()"
        )
    return number


def _validate_fixed_sizes(sizes: Any, num_devices: int) -> list[int]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
        raise EvendpError(
            f"fixed_sizes takes one non-negative int per device, got {sizes!r}; pass e.g. [3, 1, 0]"
        )
    values = list(sizes)
    if len(values) != num_devices:
        raise EvendpError(
            f"fixed_sizes({values}) has {len(values)} sizes for {num_devices} devices; pass "
            f"exactly one per entry of device_ids ({num_devices} ints, 0 for an idle device)"
        )
    for i, n in enumerate(values):
        if not is_int(n) or n < 0:
            raise EvendpError(
                f"fixed_sizes({values}): size {n!r} at position {i} is not a non-negative "
                "int; use 0 to give a device no samples"
            )
    return values


def _validate_fixed_total(sizes: list[int], total: int, dim: int) -> None:
    if sum(sizes) != total:
        raise EvendpError(
            f"fixed_sizes({sizes}) add up to {sum(sizes)}, but the batch has {total} samples "
            f"along dim={dim}; pass sizes that sum to the batch"
        )


def _add_module_prefix(
    module: nn.Module,
    state_dict: Mapping[str, Any],
    prefix: str,
    *args: Any,
) -> None:
    # Keys written by state_dict() lack "module."; rename them so the wrapper's own loader,
    # which expects "module.<key>", finds them. Keys that already have it are left alone.
    if not isinstance(state_dict, dict):
        return
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
