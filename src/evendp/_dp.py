"""Single-process balanced data parallelism: ``BalancedDataParallel`` and its loss helpers.

One step, for a global batch of N samples and devices d_0..d_{k-1}:

1. sizes n_i = largest-remainder split of N by the per-device weights (zeros allowed);
2. scatter: each active device gets its n_i consecutive samples (differentiable copies);
3. replicate: a replica per active device whose parameters are differentiable copies;
4. parallel apply: every replica runs forward in its own thread;
5. gather: outputs are concatenated; a scalar (a mean loss) is combined with weights n_i / N.

Step 5's weighting is what makes the loss, and so the gradient, equal to a single device's on
the whole batch, however uneven the split.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ._errors import EvendpError
from ._replicate import parallel_apply, replicate
from ._scatter import batch_size, batch_size_and_devices, gather_outputs, scatter
from ._split import _validate_weights, split_sizes

__all__ = ["BalancedDataParallel", "ParallelCriterion", "Scattered", "gather"]

DeviceLike = int | str | torch.device


@dataclass(frozen=True)
class Scattered:
    """Per-device outputs of ``BalancedDataParallel(..., gather=False)`` and how they were split.

    ``outputs[i]`` lives on ``devices[i]`` and covers ``sizes[i]`` consecutive samples of the
    batch. Hand it to :class:`ParallelCriterion`, or to :func:`gather` for the full output.
    """

    outputs: list[Any]
    sizes: list[int]
    devices: list[torch.device]
    dim: int
    output_device: torch.device

    @property
    def batch_size(self) -> int:
        """The number of samples across all devices (N)."""
        return sum(self.sizes)


def gather(scattered: Scattered) -> Any:
    """The full output on ``scattered.output_device``: per-device outputs joined along ``dim``.

    >>> model = BalancedDataParallel(nn.Linear(3, 2), ["cpu", "cpu"], gather=False)
    >>> parts = model(torch.randn(5, 3))
    >>> parts.sizes, gather(parts).shape
    ([3, 2], torch.Size([5, 2]))
    """
    _validate_scattered(scattered)
    return gather_outputs(
        scattered.outputs, scattered.sizes, scattered.output_device, scattered.dim
    )


class BalancedDataParallel(nn.Module):
    """``nn.DataParallel`` with per-device batch shares and an exact, sample-weighted combine.

    Args:
        module: the model; it must already sit on ``device_ids[0]``.
        device_ids: devices as ints (CUDA indices), strings or ``torch.device``. Repeats are
            *virtual* devices run in threads: ``["cpu", "cpu", "cpu"]`` runs the whole path
            with no GPU. Default: every visible CUDA device, else ``["cpu"]``.
        output_device: where outputs are gathered (default ``device_ids[0]``).
        dim: the batch dimension of inputs and outputs.
        chunk_sizes: ``None`` for an even split; one non-negative weight per device,
            normalized for every batch by largest remainder (a zero-weight device gets no
            replica and no memory); or ``"auto"``: on the first batch, plan the split that
            fits each CUDA device's live free memory (:func:`evendp.plan`; equal weights on
            virtual CPU devices, which have no memory to read).
        gather: ``False`` returns a :class:`Scattered` instead of gathered outputs.

    A ``torch.OutOfMemoryError`` raised in a replica's forward propagates unchanged, with the
    attribute ``evendp_device_index`` naming the entry of ``device_ids`` that ran out.

    A replica that returns a floating scalar (a mean loss computed inside ``forward``) is
    combined as the sample-weighted mean ``sum_i n_i/N * loss_i``: the same value, and so the
    same gradient, as one device on the whole batch. (A per-device *sum* would be averaged
    the same way: return a mean, or use ``gather=False`` with ``ParallelCriterion(...,
    reduction="sum")``.)

    >>> torch.manual_seed(0) and None
    >>> net = nn.Linear(4, 1)
    >>> model = BalancedDataParallel(net, ["cpu", "cpu", "cpu"], chunk_sizes=[2, 1, 0])
    >>> x = torch.randn(6, 4)
    >>> model(x).shape, model.last_sizes
    (torch.Size([6, 1]), [4, 2, 0])
    >>> torch.allclose(model(x), net(x))
    True
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: Sequence[DeviceLike] | None = None,
        output_device: DeviceLike | None = None,
        dim: int = 0,
        chunk_sizes: Sequence[float] | Literal["auto"] | None = None,
        gather: bool = True,
    ) -> None:
        super().__init__()
        self.module = module
        self.device_ids = _validate_devices(device_ids)
        self.output_device = (
            self.device_ids[0] if output_device is None else _to_device(output_device)
        )
        self.dim = _validate_dim(dim)
        self.chunk_sizes = chunk_sizes
        # Exact per-device counts for the next forwards, in place of the weights' split: the
        # Trainer cuts each micro-step's rows itself and sets them (None: split by weights).
        self._sizes: list[int] | None = None
        self.gather = gather
        #: The per-device sample counts of the last forward (zeros for idle devices).
        self.last_sizes: list[int] = []
        _validate_placement(module.parameters(), module.buffers(), home=self.device_ids[0])
        # One parameter, looked up afresh every step, stands for the module's placement:
        # cheaper than walking all of them, and it sees a moved or replaced parameter.
        self._sentinel = _first_parameter_slot(module)
        # Both state_dict forms load: with and without the "module." prefix.
        self.register_load_state_dict_pre_hook(_add_module_prefix)

    @property
    def chunk_sizes(self) -> list[float] | None:
        """Per-device weights (``None``: even; after ``"auto"``, what the planner chose on the
        first batch). Assigning validates them; assigning ``"auto"`` plans again."""
        return self._weights

    @chunk_sizes.setter
    def chunk_sizes(self, value: Sequence[float] | Literal["auto"] | None) -> None:
        if isinstance(value, str):
            _validate_auto(value)
            self._auto, self._weights = True, None
        else:
            self._auto, self._weights = False, _validate_chunk_sizes(value, len(self.device_ids))

    def split(self, total: int) -> list[int]:
        """The per-device sample counts for a batch of ``total`` samples."""
        return split_sizes(total, self._weights or [1.0] * len(self.device_ids))

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._sentinel is not None:
            owner, name = self._sentinel
            _validate_placement([owner._parameters[name]], home=self.device_ids[0])
        total, where = batch_size_and_devices((inputs, kwargs), self.dim)
        if total is None:
            raise EvendpError(
                "BalancedDataParallel got no tensor with a batch dimension "
                f"(dim={self.dim}) among its inputs; pass the batch as a tensor, or call "
                "the module directly when there is nothing to split"
            )
        if self._sizes is not None:
            self.last_sizes = list(self._sizes)
        else:
            if self._auto and self._weights is None:
                self._weights = self._plan_weights(inputs, kwargs)
            self.last_sizes = self.split(total)
        active = [i for i, n in enumerate(self.last_sizes) if n > 0] or [0]
        devices = [self.device_ids[i] for i in active]
        sizes = [self.last_sizes[i] for i in active]
        if len(devices) == 1 and where <= {devices[0]}:
            # The whole batch already sits on the one device that runs it: nothing to move.
            shards = [(inputs, kwargs)]
        else:
            shards = scatter((inputs, kwargs), sizes, devices, self.dim)
        replicas = self._replicas(devices, include_home=active[0] == 0)
        try:
            outputs = parallel_apply(replicas, shards, devices)
        except torch.OutOfMemoryError as error:
            # Say which entry of device_ids ran out, so a caller can shrink that share only.
            error.evendp_device_index = active[getattr(error, "evendp_replica", 0)]  # type: ignore[attr-defined]
            raise
        if not self.gather:
            return Scattered(outputs, sizes, devices, self.dim, self.output_device)
        if len(devices) == 1 and devices[0] == self.output_device:
            return outputs[0]  # as nn.DataParallel on one device: the module's own output
        return gather_outputs(outputs, sizes, self.output_device, self.dim)

    def _plan_weights(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> list[float]:
        """``chunk_sizes="auto"``: plan DP on live free memory, the first batch as the example."""
        from ._plan import auto_weights  # the planner is heavy; only "auto" needs it

        if inputs and kwargs:
            raise EvendpError(
                "chunk_sizes='auto' plans from the first batch, which must be passed all "
                f"positionally or all as keywords; got {len(inputs)} positional and "
                f"keywords {sorted(kwargs)}. Plan explicitly with evendp.plan(...) and pass "
                "chunk_sizes=plan.split instead"
            )
        home = self.output_device
        output_index = next((i for i, d in enumerate(self.device_ids) if d == home), 0)
        example = kwargs if kwargs else inputs
        return auto_weights(
            self.module, self.device_ids, example, output_device=output_index,
            gather_output=self.gather, no_grad=not torch.is_grad_enabled(),
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

    Targets are scattered with the same sizes as the outputs. With ``reduction="mean"`` (the
    criterion returns a per-device mean) the result is ``sum_i n_i/N * loss_i``; with
    ``reduction="sum"`` (the criterion returns a per-device sum) it is the plain sum.

    For a mean that is not over equal samples (``ignore_index``, padding), use a summing
    criterion with ``reduction="sum"`` and divide by the global count of real targets::

        crit = ParallelCriterion(nn.CrossEntropyLoss(reduction="sum", ignore_index=-100), "sum")
        loss = crit(scattered, targets) / (targets != -100).sum()

    >>> net = nn.Linear(3, 2)
    >>> model = BalancedDataParallel(net, ["cpu", "cpu"], chunk_sizes=[2, 1], gather=False)
    >>> x, y = torch.randn(6, 3), torch.tensor([0, 1, 1, 0, 1, 0])
    >>> loss = ParallelCriterion(nn.CrossEntropyLoss())(model(x), y)
    >>> torch.allclose(loss, nn.CrossEntropyLoss()(model.module(x), y))
    True
    """

    def __init__(self, criterion: nn.Module, reduction: Literal["mean", "sum"] = "mean") -> None:
        super().__init__()
        if reduction not in ("mean", "sum"):
            raise EvendpError(
                f"reduction={reduction!r} is not supported; use 'mean' when the criterion "
                "returns a per-device mean, 'sum' when it returns a per-device sum"
            )
        self.criterion = criterion
        self.reduction = reduction

    def forward(self, scattered: Scattered, *targets: Any, **kwargs: Any) -> torch.Tensor:
        _validate_scattered(scattered)
        target_total = batch_size((targets, kwargs), scattered.dim)
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
        criteria = replicate(self.criterion, scattered.devices, not torch.is_grad_enabled())
        losses = parallel_apply(criteria, shards, scattered.devices)
        for loss in losses:
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise EvendpError(
                    f"the criterion returned {_describe(loss)} on a device; ParallelCriterion "
                    "needs a scalar per device: use reduction='mean' or 'sum' in the criterion"
                )
        if self.reduction == "sum":
            sums = [loss.to(scattered.output_device) for loss in losses]
            return torch.stack(sums).sum()
        result: torch.Tensor = gather_outputs(
            losses, scattered.sizes, scattered.output_device, scattered.dim
        )
        return result


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
    if isinstance(device_ids, (str, torch.device, int)):
        raise EvendpError(
            f"device_ids must be a list of devices, got {device_ids!r}; "
            f"wrap it in a list: device_ids=[{device_ids!r}]"
        )
    devices = [_to_device(d) for d in device_ids]
    if not devices:
        raise EvendpError("device_ids is empty; pass at least one device, e.g. ['cpu']")
    return devices


def _validate_dim(dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise EvendpError(f"dim must be a non-negative int (the batch dimension), got {dim!r}")
    return dim


def _validate_auto(value: str) -> None:
    if value != "auto":
        raise EvendpError(
            f"chunk_sizes={value!r} is not understood; pass None (even split), 'auto' "
            "(planned from free memory), or one non-negative weight per device"
        )


def _validate_chunk_sizes(value: Sequence[float] | None, num_devices: int) -> list[float] | None:
    if value is None:
        return None
    return _validate_weights(value, expected_len=num_devices)


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
            f"expected the Scattered returned by BalancedDataParallel(..., gather=False), got "
            f"{_describe(value)}; for an already gathered output call the criterion directly"
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
