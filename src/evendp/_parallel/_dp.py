"""Single-process balanced data parallelism: ``BalancedDataParallel``.

One step, for a global batch of N samples and devices d_0..d_{k-1}:

1. sizes n_i = largest-remainder split of N by the per-device weights (zeros allowed);
2. scatter: each active device gets its n_i consecutive samples (differentiable copies);
3. replicate: a replica per active device whose parameters are differentiable copies;
4. parallel apply: every replica runs forward in its own thread;
5. gather: outputs are concatenated; a scalar (a mean loss over c_i counted items: samples by
   default, or what ``count_fn`` says, e.g. non-ignored tokens) is combined with weights
   c_i / sum_j c_j, leaving out shares that count no item.

Step 5's weighting is what makes the loss, and so the gradient, equal to a single device's on
the whole batch, however uneven the split. The loss computed per device is
:mod:`._criterion`'s (with the output kept per device, :class:`Scattered`, and the checks of
counts both share).
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import nn

from .._core._batchnorm import warn_if_batchnorm_split_unevenly
from .._core._calls import call
from .._core._counting import auto_count, holds_ignored, uncounted_warning
from .._core._errors import EvendpError
from .._core._oom_errors import is_oom_error, replica_of, tag_device_index
from .._core._split import largest_remainder, validate_weights
from .._core._validate import is_int, validate_bool, validate_int
from ._criterion import Count, Scattered, describe, validate_callable, validate_counts
from ._replicate import parallel_apply, replicate
from ._scatter import gather_outputs, map_tensors, row_count, row_count_and_devices, scatter

__all__ = ["BalancedDataParallel", "validate_devices"]

DeviceLike = int | str | torch.device


Weights = Sequence[float] | Literal["auto"] | None


# PyTorch's message when BatchNorm in training mode gets one value per channel.
_BATCHNORM_ONE_VALUE = "Expected more than 1 value per channel when training"
# A forward of weights="auto" before any plan: planning is asked for, never done in forward.
_UNPLANNED = (
    "BalancedDataParallel(weights='auto') has no weights yet: it plans before the first "
    "forward, not inside it; pass example= (the batch as forward takes it, e.g. example=(x,)) "
    "to BalancedDataParallel, or call model.plan_weights(x) before this forward"
)


def to_device(device: DeviceLike) -> torch.device:
    """``device`` as a ``torch.device`` (an int is a CUDA index); a CUDA one must exist here."""
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
    if resolved.type != "cuda":
        return resolved
    if not torch.cuda.is_available():
        raise EvendpError(
            f"device {resolved} was requested but CUDA is not available here; run on virtual "
            "devices instead, e.g. device_ids=['cpu', 'cpu', 'cpu']"
        )
    index = torch.cuda.current_device() if resolved.index is None else resolved.index
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


def validate_devices(device_ids: Sequence[DeviceLike] | None) -> list[torch.device]:
    if device_ids is None:
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]
    if isinstance(device_ids, (str, torch.device, int)) or not isinstance(device_ids, Sequence):
        raise EvendpError(
            f"device_ids must be a list of devices, got {device_ids!r}; "
            f"wrap it in a list: device_ids=[{device_ids!r}]"
        )
    devices = [to_device(d) for d in device_ids]
    if not devices:
        raise EvendpError("device_ids is empty; pass at least one device, e.g. ['cpu']")
    return devices


def validate_auto(value: str) -> None:
    if value != "auto":
        raise EvendpError(
            f"weights={value!r} is not understood; pass None (even split), 'auto' "
            "(planned from free memory), or one non-negative weight per device"
        )


def validate_placement(*groups: Iterable[torch.Tensor | None], home: torch.device) -> None:
    for tensor in itertools.chain(*groups):
        if tensor is not None and not _same_device(tensor.device, home):
            raise EvendpError(
                f"the module's tensors must sit on device_ids[0]={home}, but one is on "
                f"{tensor.device}; call module.to({str(home)!r}) before wrapping it, or put "
                f"its device first in device_ids. Note: CUDA_VISIBLE_DEVICES renumbers GPUs "
                "(with CUDA_VISIBLE_DEVICES=2,3 physical GPU 2 is cuda:0); "
                "evendp.select_devices sets it for you before CUDA starts"
            )


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.type != "cuda" or a.index == b.index


def validate_module(module: Any, device_ids: Any) -> None:
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
        f"{describe(module)}; call BalancedDataParallel(model, device_ids, weights=[...])"
    )


def validate_fixed_sizes(sizes: Any, num_devices: int) -> list[int]:
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


def validate_batch_rows(total: int | None, dim: int) -> int:
    """The batch's row count, or raise when no input tensor has a batch dimension."""
    if total is None:
        raise EvendpError(
            "BalancedDataParallel got no tensor with a batch dimension "
            f"(dim={dim}) among its inputs; pass the batch as a tensor, or call "
            "the module directly when there is nothing to split"
        )
    return total


def validate_example(example: Any, auto: bool) -> None:
    """``example=`` is one batch as ``forward`` takes it, and only ``weights="auto"`` uses it."""
    if example is None:
        return
    if not auto:
        raise EvendpError(
            "example= is the batch weights='auto' plans on, but the weights are not 'auto'; "
            "drop example=, or pass weights='auto' with it"
        )
    if not isinstance(example, (tuple, list, dict, torch.Tensor)):
        raise EvendpError(
            f"example= must be one batch as forward takes it, got {describe(example)}; pass "
            "a tuple of positional inputs, e.g. example=(x,), or a dict of keyword inputs, "
            "e.g. example={'input_ids': ids, 'labels': labels}"
        )


class _Split(NamedTuple):
    """One forward's split over the devices that get samples."""

    total: int  # the batch's rows
    active: list[int]  # entries of device_ids with a share
    devices: list[torch.device]
    sizes: list[int]


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
            replica and no memory); or ``"auto"``: the split that fits each device's memory,
            planned on ``example`` or by :meth:`plan_weights` (the Trainer's one-process
            ``"auto"``: ``EVENDP_MEMORY`` when declared, else each CUDA device's live free
            memory; equal weights on virtual CPU devices, which have no memory to read).
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
        example: with ``weights="auto"``, one batch as ``forward`` takes it, planned on
            now: a tuple of positional inputs (``example=(x,)``), a dict of keyword inputs
            (``example={"input_ids": ids, "labels": labels}``) or one tensor. Without it,
            call :meth:`plan_weights` before the first forward (a forward before any plan
            is refused).

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

    ``"auto"`` plans once, before training, and says the split it chose (on stderr):

    >>> auto = BalancedDataParallel(net, ["cpu"] * 3, weights="auto", example=(x,))
    >>> auto.weights, auto.plan_weights(x)  # CPU devices: no memory to read, even
    ([1.0, 1.0, 1.0], [1.0, 1.0, 1.0])

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
        example: Any = None,
    ) -> None:
        super().__init__()
        validate_module(module, device_ids)
        self.module = module
        self.device_ids = validate_devices(device_ids)
        self.output_device = (
            self.device_ids[0] if output_device is None else to_device(output_device)
        )
        self.dim = int(validate_int("dim", dim, minimum=0, example="dim=0, the batch dimension"))
        self.weights = weights
        validate_example(example, auto=self._unplanned)
        self.gather_output = validate_bool("gather_output", gather_output)
        self.count_fn = validate_callable("count_fn", count_fn)
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
        validate_placement(module.parameters(), module.buffers(), home=self.device_ids[0])
        # One parameter, looked up afresh every step, stands for the module's placement:
        # cheaper than walking all of them, and it sees a moved or replaced parameter.
        self._sentinel = _first_parameter_slot(module)
        # Both state_dict forms load: with and without the "module." prefix.
        self.register_load_state_dict_pre_hook(_add_module_prefix)
        if example is not None:
            call(self.plan_weights, example)

    @property
    def weights(self) -> list[float] | None:
        """Per-device weights (``None``: even; after ``"auto"``, what the planner chose).
        Assigning validates them; after assigning ``"auto"``, call :meth:`plan_weights`
        before the next forward."""
        return self._weights

    @weights.setter
    def weights(self, value: Weights) -> None:
        if isinstance(value, str):
            validate_auto(value)
            self._unplanned, self._weights = True, None
        else:
            self._unplanned = False
            n = len(self.device_ids)
            self._weights = None if value is None else validate_weights(value, expected_len=n)
            warn_if_batchnorm_split_unevenly(self.module, self._weights, "weights")

    def plan_weights(self, *inputs: Any, **kwargs: Any) -> list[float]:
        """Plan ``weights="auto"`` on one batch, passed as to ``forward``; use and return them.

        The split that fits each device's memory (see ``weights``), for the step the grad mode
        here runs: under ``torch.no_grad()`` a forward only, which fits larger shares. It
        says the split of this batch on stderr, as the Trainer's ``"auto"`` does.

        >>> model = BalancedDataParallel(nn.Linear(4, 1), ["cpu"] * 2, weights="auto")
        >>> model.plan_weights(torch.randn(6, 4))  # CPU devices: no memory to read, even
        [1.0, 1.0]
        """
        from .._planning._balance import device_weights_for_memory, say_auto_sizes

        if inputs and kwargs:
            raise EvendpError(
                "weights='auto' plans from an example batch, which must be passed all "
                f"positionally or all as keywords; got {len(inputs)} positional and "
                f"keywords {sorted(kwargs)}. Plan explicitly with evendp.plan(...) and pass "
                "weights=plan.split instead"
            )
        total = validate_batch_rows(row_count((inputs, kwargs), self.dim), self.dim)
        home = next((i for i, d in enumerate(self.device_ids) if d == self.output_device), 0)
        weights, source = device_weights_for_memory(
            self.module, kwargs if kwargs else inputs, self.device_ids, output_device=home,
            gather_output=self.gather_output, no_grad=not torch.is_grad_enabled(),
        )  # fmt: skip
        self.weights = weights
        say_auto_sizes(self.split(total), None, rank=0, option="weights", per="device",
                       source=source)  # fmt: skip
        return list(weights)

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
        self._replica_context = validate_callable("hook", hook)

    @property
    def replica_context(self) -> Callable[[int], contextlib.AbstractContextManager[Any]] | None:
        """The hook each replica's forward runs inside (:meth:`set_replica_context`)."""
        return self._replica_context

    def split(self, total: int) -> list[int]:
        """The per-device sample counts for a batch of ``total`` samples."""
        validate_int("total", total, minimum=0, example="32")  # the weights: when assigned
        return largest_remainder(total, self._weights or [1.0] * len(self.device_ids))

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
        # Checked before anything changes: refused sizes leave the split as it was.
        outer, self._sizes = self._sizes, validate_fixed_sizes(sizes, len(self.device_ids))
        try:
            yield
        finally:
            self._sizes = outer

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        # As nn.DataParallel.forward: split, scatter, replicate, run the replicas, gather.
        split, where = self._split_batch(inputs, kwargs)
        if len(split.devices) == 1 and where <= {split.devices[0]}:
            shards = [(inputs, kwargs)]  # the batch already sits on the one device that runs it
        else:
            shards = scatter((inputs, kwargs), split.sizes, split.devices, self.dim)
        count_fn = self.count_fn or self._label_count
        with torch.no_grad():  # counted before forward: nothing waits for them yet
            raw_counts = None if count_fn is None else [count_fn(*a, **kw) for a, kw in shards]
        outputs = self._run_replicas(shards, split)
        named = [f"device_ids[{i}]={self.device_ids[i]}" for i in split.active]
        counts = validate_counts(raw_counts, split.sizes, named)
        if not self.gather_output:
            return Scattered(
                outputs, split.sizes, split.devices, self.dim, self.output_device, counts
            )
        # Where evendp itself combines the means (not for a Scattered: its reader does).
        if self.count_fn is None and self._label_count is None and len(self.device_ids) > 1:
            self._check_uncounted(outputs[0], inputs, kwargs)
        if len(split.devices) == 1 and split.devices[0] == self.output_device and counts[0] > 0:
            return outputs[0]  # as nn.DataParallel on one device: the module's own output
        return gather_outputs(outputs, split.sizes, self.output_device, self.dim, counts)

    def _split_batch(
        self, inputs: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[_Split, set[torch.device]]:
        """This forward's split, and the devices the batch's tensors are on."""
        if self._sentinel is not None:  # the module is still home
            owner, name = self._sentinel
            validate_placement([owner._parameters[name]], home=self.device_ids[0])
        rows, where = row_count_and_devices((inputs, kwargs), self.dim)
        total = validate_batch_rows(rows, self.dim)
        if self._sizes is not None:
            if sum(self._sizes) != total:
                raise EvendpError(
                    f"fixed_sizes({self._sizes}) add up to {sum(self._sizes)}, but the batch "
                    f"has {total} samples along dim={self.dim}; pass sizes that sum to the batch"
                )
            self.last_sizes = list(self._sizes)
        elif self._unplanned:
            raise EvendpError(_UNPLANNED)
        else:  # the weights were checked when assigned: not again every step
            weights = self._weights or [1.0] * len(self.device_ids)
            self.last_sizes = largest_remainder(total, weights)
        active = [i for i, n in enumerate(self.last_sizes) if n > 0] or [0]
        devices = [self.device_ids[i] for i in active]
        return _Split(total, active, devices, [self.last_sizes[i] for i in active]), where

    def _run_replicas(self, shards: list[Any], split: _Split) -> list[Any]:
        # The home device runs the module itself: no copies, and buffer updates persist.
        home, devices = split.active[0] == 0, split.devices
        detach = not torch.is_grad_enabled()
        copies = replicate(self.module, devices[1:] if home else devices, detach)
        try:
            hook = self._replica_context
            contexts = None if hook is None else [hook(i) for i in split.active]
            replicas = [self.module, *copies] if home else copies
            return parallel_apply(replicas, shards, devices, contexts)
        except (RuntimeError, ValueError) as error:
            index = split.active[replica_of(error)]
            if is_oom_error(error):
                # Say which entry of device_ids ran out, so a caller can shrink that share only
                # (also for cuBLAS/cuDNN allocation failures, which are plain RuntimeErrors).
                tag_device_index(error, index)
                raise
            share = self.last_sizes[index]
            if not isinstance(error, ValueError) or _BATCHNORM_ONE_VALUE not in str(error):
                raise
            if share == split.total:  # no split: torch's own message says it
                raise
            raise EvendpError(
                f"device_ids[{index}]={self.device_ids[index]} got a share of {share} "
                f"sample(s) of the batch of {split.total} (split {self.last_sizes}), and "
                "BatchNorm in training mode needs more than one value per channel; give every "
                "active device at least 2 samples (other weights, or a larger batch), put the "
                "BatchNorm layers in eval() mode, or use GroupNorm / LayerNorm"
            ) from error

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

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped module's state dict: its own keys, no ``module.`` prefix."""
        return self.module.state_dict(*args, **kwargs)


def _first_parameter_slot(module: nn.Module) -> tuple[nn.Module, str] | None:
    slots = ((m, n) for m in module.modules() for n, p in m._parameters.items() if p is not None)
    return next(slots, None)


def _add_module_prefix(_module: nn.Module, state_dict: Any, prefix: str, *_: Any) -> None:
    # Keys written by state_dict() lack "module."; rename them so the wrapper's own loader,
    # which expects "module.<key>", finds them. Keys that already have it are left alone.
    if not isinstance(state_dict, dict):
        return
    inner = prefix + "module."
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)
