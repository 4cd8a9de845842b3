"""The process-group side of uneven DDP: starting a rank, where it communicates, the loss scale.

Why the scale (:func:`ddp_loss`): DDP computes ``(1/W) * sum_r grad(L_r)``; with
``L_r = S_r * W / N`` (``S_r`` the rank's summed loss, ``N`` the global count) that is
``sum_r grad(S_r) / N``, the gradient of the mean over all ``N`` samples, whatever the
per-rank counts. A per-rank mean gives ``(1/W) * sum_r grad(S_r) / n_r`` instead, which
over-weights the samples of small ranks.
"""

from __future__ import annotations

import gc
import inspect
import numbers
import os
import sys
import time
from collections import deque
from collections.abc import Iterable, Iterator
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .._core._errors import EvendpError
from .._core._exact import mean_scale, step_count
from .._core._validate import validate_bool, validate_count, validate_device, validate_float

__all__ = [
    "BUCKET_BYTES",
    "bucket_tensors",
    "all_reduce_gradients",
    "all_reduce_sum",
    "comm_device",
    "ddp_loss",
    "finish_distributed",
    "global_count",
    "global_mean",
    "init_distributed",
    "rank_cuda_device",
    "settle_group",
    "world_size",
]


# ---------------------------------------------------------------------------------------------
# Where this rank communicates


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Ranks in ``group`` (the default group when ``None``); 1 without a process group.

    >>> world_size()
    1
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def rank_cuda_device() -> torch.device:
    """This rank's own GPU: ``cuda:LOCAL_RANK``, or ``cuda:0`` when the rank sees one GPU
    (a scheduler that gives each rank its own: SLURM ``--gpus-per-task``); any other
    ``LOCAL_RANK`` past the visible devices is an error (NCCL refuses two ranks on one GPU).
    """
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count()
    if local < count:
        return torch.device("cuda", local)
    if count == 1:
        return torch.device("cuda", 0)
    raise EvendpError(
        f"LOCAL_RANK={local} but this process sees {count} GPU(s); start at most one rank per "
        "visible GPU (torchrun --nproc-per-node), give each rank its own GPU, or use "
        "backend='gloo'"
    )


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a tensor must sit to be communicated: gloo, the CPU; NCCL, the rank's own GPU
    (the group's bound one, else :func:`rank_cuda_device`), never merely the current device
    (``cuda:0`` on a rank that did not call ``torch.cuda.set_device``).

    >>> comm_device()  # no process group: the CPU
    device(type='cpu')
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        bound = getattr(pg, "bound_device_id", None)  # init_process_group(device_id=...)'s
        return torch.device(bound) if bound is not None else rank_cuda_device()
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``t`` summed over ranks, returned on ``t``'s device (gloo reduces CPU and CUDA tensors
    where they are, NCCL only on its own GPU)."""
    moved = t.to(comm_device(group)) if dist.get_backend(group) == "nccl" else t
    dist.all_reduce(moved, group=group)
    return moved.to(t.device)


# ---------------------------------------------------------------------------------------------
# The loss


def _count_tensor(
    count: torch.Tensor | float, device: torch.device, name: str = "local_count"
) -> torch.Tensor:
    """``count`` as a fresh tensor (never the caller's: all-reduce works in place)."""
    if isinstance(count, torch.Tensor):
        # Its value is checked only where reading it waits for no GPU (else kind and shape).
        validate_count(name, count, integral=False, check_values=count.device.type == "cpu")
        t = count.detach().to(device=device)
        dtype = torch.int64 if not (t.is_floating_point() or t.is_complex()) else torch.float64
        return t.to(dtype=dtype, copy=True)
    if isinstance(count, bool) or not isinstance(count, numbers.Real):
        raise EvendpError(f"{name} must be an int, float or tensor, got {count!r}")
    if not count >= 0:  # also NaN
        raise EvendpError(f"{name} must be >= 0 (samples or tokens), got {count!r}")
    validate_count(name, count, integral=False)  # infinity
    dtype = torch.int64 if isinstance(count, numbers.Integral) else torch.float64
    return torch.tensor(count, dtype=dtype, device=device)


def global_count(
    local_count: torch.Tensor | float,
    device: torch.device | str | None = None,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The sum of ``local_count`` over all ranks (one all-reduce; no process group: itself).

    For gradient accumulation: count ALL of a step's micro-batches, call this once, and pass
    the result as ``global_count`` to every micro-step's :func:`ddp_loss`. ``device``
    defaults to :func:`comm_device`.

    >>> global_count(7)
    tensor(7)
    """
    where = comm_device(group) if device is None else validate_device("device", device)
    reduce = (lambda t: all_reduce_sum(t, group)) if world_size(group) > 1 else None
    # A count was given: the result is a tensor, never the samples shortcut.
    return cast(torch.Tensor, step_count(_count_tensor(local_count, where), all_reduce=reduce))


_global_count = global_count  # ddp_loss's parameter of the same name shadows it


def ddp_loss(
    local_sum: torch.Tensor,
    local_count: torch.Tensor | float,
    global_count: torch.Tensor | float | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The loss to ``backward()`` so DDP's/FSDP2's averaged gradient is the global-mean gradient.

    ``local_sum``: this rank's loss summed over its samples (``reduction="sum"``),
    ``local_count``: how many samples (or non-ignored tokens) it summed. Returns ``local_sum *
    world_size / global_count``, ``global_count`` all-reduced here when not given (0: a zero
    loss). A rank with no samples runs forward on its empty batch: its zero ``local_sum`` is
    connected to every parameter, so DDP sees a gradient for each.

    >>> out = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    >>> ddp_loss(out.sum(), 3)  # one process: the plain mean
    tensor(2., grad_fn=<MulBackward0>)
    >>> ddp_loss(out.sum(), 3, global_count=6)  # 3 of 6 samples, world_size 1 here
    tensor(1., grad_fn=<MulBackward0>)
    """
    _validate_local_sum(local_sum)
    world = world_size(group)
    # At least fp32, so a bf16 sum is scaled without bf16 round-off.
    loss = local_sum if local_sum.dtype in (torch.float32, torch.float64) else local_sum.float()
    if isinstance(global_count, numbers.Real) and not isinstance(global_count, bool):
        # A plain number: one multiply, no tensors to build (this runs every step).
        total_n = float(global_count)
        if not total_n >= 0:  # also catches NaN
            raise EvendpError(f"global_count must be >= 0, got {global_count!r}")
        return loss * mean_scale(total_n, world)
    if global_count is None:
        total = _global_count(local_count, local_sum.device, group)
    else:
        total = _count_tensor(global_count, local_sum.device, "global_count")
    # Zero samples everywhere means local_sum is 0 too: the scale divides by 1, no host sync.
    return loss * mean_scale(total, world, dtype=loss.dtype)


def _validate_local_sum(local_sum: object) -> None:
    if not isinstance(local_sum, torch.Tensor) or local_sum.numel() != 1:
        got = (
            f"shape {tuple(local_sum.shape)}"
            if isinstance(local_sum, torch.Tensor)
            else repr(local_sum)
        )
        raise EvendpError(
            f"local_sum must be a tensor (the summed loss of this rank), got {got}; e.g. "
            "cross_entropy(logits, y, reduction='sum')"
        )


def global_mean(
    local_sum: torch.Tensor,
    local_count: torch.Tensor | float,
    *,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """The true mean loss over all ranks' samples, detached, for logging (one all-reduce).

    Every rank gets the same value (NaN when no rank had a sample). A collective: never
    inside ``if rank == 0:``; for rank-0 logging, :class:`evendp.StepMean` has it already.

    >>> global_mean(torch.tensor(6.0), 4)
    tensor(1.5000)
    """
    _validate_local_sum(local_sum)
    pair = torch.stack(
        [
            local_sum.detach().to(torch.float64).reshape(()),
            _count_tensor(local_count, local_sum.device).to(torch.float64).reshape(()),
        ]
    )  # (2,): sum, count
    if world_size(group) > 1:
        pair = all_reduce_sum(pair, group)
    return (pair[0] / pair[1]).to(local_sum.dtype)


# ---------------------------------------------------------------------------------------------
# Starting a rank


def init_distributed(backend: str | None = None, **kwargs: Any) -> torch.device:
    """Start the default process group of a ``torchrun`` rank; return the rank's device.

    ``backend=None`` picks NCCL when every local rank has a GPU of its own (or sees one
    through a one-entry ``CUDA_VISIBLE_DEVICES``), else gloo and the CPU. Under NCCL the
    rank's GPU becomes the current device and binds the group (``device_id``). Other keyword
    arguments go to ``torch.distributed.init_process_group``; ``timeout`` may be given in
    seconds (without one, a hung rank keeps the others waiting gloo's 30 minutes).

    End the run with :func:`finish_distributed`. Why not ``init_process_group`` directly:
    importing ``torch.distributed.fsdp`` while a group exists (``torch.optim`` and
    ``torch.compile`` do on first use) binds that group into default arguments for good; its
    gloo threads then die during interpreter exit, aborting a run that succeeded (exit -6,
    about once in thirty runs, torch 2.13). Importing it first avoids that.

    >>> import torch.distributed as dist
    >>> init_distributed("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=600)
    device(type='cpu')
    >>> dist.get_backend()
    'gloo'
    >>> dist.destroy_process_group()
    """
    if backend not in (None, "gloo", "nccl"):
        raise EvendpError(
            f"backend={backend!r} is not supported; expected 'nccl' (GPU ranks), 'gloo' (CPU "
            "ranks) or None to choose by whether CUDA has a device for every local rank"
        )
    if "timeout" in kwargs and not isinstance(kwargs["timeout"], timedelta):
        seconds = validate_float("timeout", kwargs["timeout"], positive=True, example="600")
        kwargs["timeout"] = timedelta(seconds=seconds)
    import torch.distributed.fsdp  # before the group exists: see above

    if backend is None:
        backend = "nccl" if _cuda_for_every_local_rank() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":  # --- GPU-only: the rank's own device, bound to the group
        device = rank_cuda_device()
        torch.cuda.set_device(device)
        # Bound, NCCL creates its communicator on this device eagerly, and every collective
        # (barrier included) uses it instead of guessing from the current device.
        kwargs.setdefault("device_id", device)
    dist.init_process_group(backend, **kwargs)
    return device


def _cuda_for_every_local_rank() -> bool:
    """Whether each local rank has a GPU of its own: one per local rank, or one visible
    through a one-entry ``CUDA_VISIBLE_DEVICES`` (unset, one GPU is shared: gloo)."""
    if not torch.cuda.is_available():
        return False
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    count = torch.cuda.device_count()
    if count >= local_world:
        return True
    visible = [e for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if e.strip()]
    return count == 1 and len(visible) == 1


# Time given to gloo's worker threads to drop finished collectives before the group goes.
_WORKER_GRACE_S = 0.05


def finish_distributed() -> None:
    """End a successful run: wait for every rank, then destroy the default process group.

    On every rank once training is done (not on an error path); quiet without a group. Why
    not ``destroy_process_group()`` alone: gloo's worker threads drop finished collectives
    holding the GIL, and the destructor joins them holding it too: a deadlock (ranks pinned to
    one core each). So a barrier, a short sleep with the GIL released, then the destroy.

    >>> import torch.distributed as dist
    >>> _ = init_distributed("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> finish_distributed()
    >>> dist.is_initialized()
    False
    >>> finish_distributed()  # nothing left to end: quiet
    """
    if not (dist.is_available() and dist.is_initialized()):
        return  # nothing to end: safe in a `finally` whether or not the start succeeded
    settle_group()
    dist.destroy_process_group()


def settle_group(*, collect: bool = True) -> None:
    """:func:`finish_distributed` but the destroy, for teardowns that destroy the group
    themselves (Accelerate's ``end_training``); on every rank. ``collect=False``: no garbage
    collection (the caller knows no dropped wrapper sits in a reference cycle).

    >>> import torch.distributed as dist
    >>> _ = init_distributed("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> settle_group()  # the group stays: whoever ends the run destroys it
    >>> dist.is_initialized()
    True
    >>> finish_distributed()
    >>> settle_group()  # no group: nothing to settle
    """
    validate_bool("collect", collect)
    if not (dist.is_available() and dist.is_initialized()):
        return
    _unbind_early_defaults()
    # DDP wrappers no longer referenced but kept by reference cycles hold the group: free
    # them now, while it is alive, not in a late teardown where gloo's threads abort.
    if collect:
        gc.collect()
    dist.barrier()
    time.sleep(_WORKER_GRACE_S)  # GIL released: the workers drop the barrier's tensors


# Methods whose ``group=GroupMember.WORLD`` default captures the default group at import:
# DeepSpeed's, imported by Accelerate (``unwrap_model``) once the Trainer's group exists, even
# in runs that never use DeepSpeed. Their bodies read ``None`` as the current world.
_EARLY_BOUND = (("deepspeed.comm.torch", "TorchBackend", ("barrier", "monitored_barrier")),)


def _unbind_early_defaults() -> None:
    """Turn a process group captured in a default argument back into ``None`` (the same to
    those methods): held there, a destroy cannot free it (see :func:`init_distributed`)."""
    for module, owner, names in _EARLY_BOUND:
        cls = getattr(sys.modules.get(module), owner, None)
        for name in names:
            method = getattr(cls, name, None)
            if method is None:
                continue
            fn = inspect.unwrap(method)  # under a compiler.disable wrapper on older torch
            defaults = getattr(fn, "__defaults__", None)
            if defaults and isinstance(defaults[0], dist.ProcessGroup):
                fn.__defaults__ = (None, *defaults[1:])


# ---------------------------------------------------------------------------------------------
# Gradients reduced after a local backward


BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


def all_reduce_gradients(
    parameters: Iterable[torch.nn.Parameter],
    group: dist.ProcessGroup | None = None,
    *,
    bucket_bytes: int = BUCKET_BYTES,
) -> None:
    """Average ``.grad`` over ranks (sum / world size, as DDP does), in place, in buckets.

    For gradients accumulated with every backward local (an OOM on one rank leaves no other
    waiting): every rank calls it alike. A parameter without a gradient contributes zeros.
    Buckets of about ``bucket_bytes`` (DDP's 25 MiB), one all-reduce each, at most two in
    flight: a gradient filling a bucket alone is reduced in place, smaller ones flattened.

    >>> p = torch.nn.Parameter(torch.ones(2))
    >>> p.grad = torch.full((2,), 3.0)
    >>> all_reduce_gradients([p])  # one process: unchanged
    >>> p.grad
    tensor([3., 3.])
    """
    world = world_size(group)
    if world == 1:
        return
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.grad is not None]
    in_flight: deque[tuple[dist.Work | None, torch.Tensor, list[torch.Tensor]]] = deque()
    for bucket in bucket_tensors(grads, bucket_bytes):
        alone = len(bucket) == 1 and bucket[0].is_contiguous()
        flat = bucket[0] if alone else _flatten_dense_tensors(bucket)  # (sum of numels,)
        in_flight.append((dist.all_reduce(flat, group=group, async_op=True), flat, bucket))
        if len(in_flight) > 2:
            _unpack(*in_flight.popleft(), world)
    while in_flight:
        _unpack(*in_flight.popleft(), world)


def bucket_tensors(grads: list[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, about ``bucket_bytes`` per bucket."""
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        same = not bucket or (g.dtype, g.device) == (bucket[0].dtype, bucket[0].device)
        if bucket and (not same or size + nbytes > bucket_bytes):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


def _unpack(
    work: dist.Work | None,
    flat: torch.Tensor,
    bucket: list[torch.Tensor],
    world: int,
) -> None:
    # Gradients are averaged, as DDP does.
    if work is not None:
        work.wait()
    if flat is bucket[0]:
        flat.div_(world)
        return
    for g, reduced in zip(bucket, _unflatten_dense_tensors(flat, bucket), strict=True):
        g.copy_(reduced.div_(world))
