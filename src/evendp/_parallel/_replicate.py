"""Differentiable module replicas and running them side by side, one thread per device.

Works the same for real CUDA devices and for *virtual* devices (the same device listed more
than once, e.g. ``["cpu", "cpu", "cpu"]``): a parameter copy is ``param.to(device)``, which is
differentiable and, on the same device, is the parameter itself, so every replica's gradient
flows back into the one original parameter. Copies to distinct GPUs go through PyTorch's
coalesced broadcast instead (as ``nn.DataParallel`` does: few large copies, one autograd node
whose backward sums the gradients with ``ReduceAddCoalesced``), not one ``.to()`` per tensor.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from .._core._oom_errors import tag_replica
from ._scatter import to_device

__all__ = ["parallel_apply", "replicate"]


def replicate(module: nn.Module, devices: Sequence[torch.device], detach: bool) -> list[nn.Module]:
    """Shallow replicas of ``module`` on ``devices`` whose parameters are differentiable copies.

    Buffers are copied, never shared, so BatchNorm statistics updated inside a replica do not
    race with the original (as in ``nn.DataParallel``, only the original's updates persist).

    >>> net = nn.Linear(2, 1)
    >>> [r] = replicate(net, [torch.device("cpu")], detach=False)
    >>> r.weight is net.weight
    True
    """
    if not devices:
        return []
    originals = list(module.modules())
    position = {id(m): i for i, m in enumerate(originals)}
    broadcast = _coalesced_copies(originals, devices, detach)
    replicas = []
    for device in devices:
        copies = [m._replicate_for_data_parallel() for m in originals]
        # A parameter shared by two modules (tied embeddings) is copied once per device.
        param_copies: dict[int, torch.Tensor] = dict(broadcast.get(device, {}))
        for original, copy in zip(originals, copies, strict=True):
            for name, child in original._modules.items():
                copy._modules[name] = None if child is None else copies[position[id(child)]]
            for name, param in original._parameters.items():
                if param is not None and id(param) not in param_copies:
                    source = param.detach() if detach else param
                    param_copies[id(param)] = to_device(source, device)
                # Replica parameters are not leaves: they live as plain attributes.
                setattr(copy, name, None if param is None else param_copies[id(param)])
            for name, buf in original._buffers.items():
                if buf is not None:  # copied even on its own device: never shared
                    buf = buf.clone() if buf.device == device else to_device(buf, device)
                copy._buffers[name] = buf
        replicas.append(copies[0])
    return replicas


def _coalesced_copies(
    originals: list[nn.Module], devices: Sequence[torch.device], detach: bool
) -> dict[torch.device, dict[int, torch.Tensor]]:
    """``{device: {id(param): copy}}`` from one coalesced broadcast to the other distinct GPUs.

    Only when every parameter sits on one GPU and the targets are distinct GPUs: repeated
    (virtual) devices and the CPU keep ``param.to(device)``, which on the parameter's own
    device is the parameter itself.
    """
    # Every parameter once (a tied one only once), in module order.
    unique = {id(p): p for m in originals for p in m._parameters.values() if p is not None}
    params: list[torch.Tensor] = list(unique.values())
    targets = _broadcast_targets([p.device for p in params], devices)
    if targets is None:
        return {}
    per_device = _broadcast(params, targets, detach)
    # The source comes first, as torch's broadcast wants; its own "copies" are not used.
    return {
        device: {id(p): c for p, c in zip(params, copies, strict=True)}
        for device, copies in zip(targets[1:], per_device[1:], strict=True)
    }


def _broadcast_targets(
    param_devices: Sequence[torch.device], devices: Sequence[torch.device]
) -> list[torch.device] | None:
    """``[source, *other targets]`` for one coalesced broadcast, or ``None`` where it does not
    apply: parameters not all on one GPU, a repeated (virtual) device, a CPU target, or no
    target other than the source.

    >>> cuda = [torch.device("cuda", i) for i in range(3)]
    >>> _broadcast_targets([cuda[0]], cuda[1:])
    [device(type='cuda', index=0), device(type='cuda', index=1), device(type='cuda', index=2)]
    >>> _broadcast_targets([cuda[0]], [cuda[1], cuda[1]]) is None
    True
    """
    if not param_devices or len(set(param_devices)) != 1:
        return None
    source = param_devices[0]
    devices = [torch.device(d) for d in devices]
    others = [d for d in devices if d != source]
    if (
        source.type != "cuda"
        or len(set(devices)) != len(devices)
        or any(d.type != "cuda" for d in others)
        or not others
    ):
        return None
    return [source, *others]


def _broadcast(
    params: list[torch.Tensor], targets: list[torch.device], detach: bool
) -> list[list[torch.Tensor]]:
    """Per target, copies of ``params``: PyTorch's own coalesced replicate copy (GPU only)."""
    from torch.nn.parallel.replicate import _broadcast_coalesced_reshape

    return [list(c) for c in _broadcast_coalesced_reshape(params, targets, detach)]


def parallel_apply(
    modules: Sequence[nn.Module],
    shards: Sequence[tuple[Sequence[Any], dict[str, Any]]],
    devices: Sequence[torch.device],
    contexts: Sequence[contextlib.AbstractContextManager[Any]] | None = None,
) -> list[Any]:
    """Call ``modules[i](*args_i, **kwargs_i)`` on ``devices[i]``, in threads when more than one.

    Grad mode and autocast state are thread-local in PyTorch, so each thread re-enters the
    caller's. An exception from a replica is re-raised unchanged (a ``torch.OutOfMemoryError``
    stays one) with a note naming the device. ``contexts[i]``, when given, is entered around
    replica ``i``'s call inside its thread (the hook of ``evendp._training._budget``'s memory
    budgets).

    >>> out = parallel_apply([nn.Identity()] * 2, [((torch.ones(1),), {})] * 2, ["cpu"] * 2)
    >>> [o.item() for o in out]
    [1.0, 1.0]
    """
    devices = [torch.device(d) for d in devices]
    state = _ThreadState(devices)
    if len(modules) == 1:  # the caller's own thread, but on the replica's device and stream
        args, kwargs = shards[0]
        with state.enter(0), contexts[0] if contexts else contextlib.nullcontext():
            return [modules[0](*args, **kwargs)]

    results: list[Any] = [None] * len(modules)
    errors: list[BaseException | None] = [None] * len(modules)

    def work(i: int) -> None:
        try:
            with state.enter(i), contexts[i] if contexts else contextlib.nullcontext():
                args, kwargs = shards[i]
                results[i] = modules[i](*args, **kwargs)
        except BaseException as exc:  # re-raised in the caller's thread below
            errors[i] = exc

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(modules))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, error in enumerate(errors):
        if error is not None:
            if hasattr(error, "add_note"):  # Python 3.11+
                error.add_note(f"evendp: raised by the replica on {devices[i]} (replica {i})")
            tag_replica(error, i)  # read by BalancedDataParallel
            raise error
    return results


class _ThreadState:
    """The caller's thread-local torch state, to re-enter inside each worker thread."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices
        self.grad_enabled = torch.is_grad_enabled()
        self.autocast = {
            kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in {d.type for d in devices}
        }
        # CUDA work in a thread must go to the stream the caller was using on that device.
        self.streams = [torch.cuda.current_stream(d) if d.type == "cuda" else None for d in devices]

    @contextlib.contextmanager
    def enter(self, i: int) -> Iterator[None]:
        device = self.devices[i]
        enabled, dtype = self.autocast[device.type]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            stack.enter_context(torch.autocast(device.type, dtype=dtype, enabled=enabled))
            stream = self.streams[i]
            if stream is not None:  # GPU only
                stack.enter_context(torch.cuda.device(device))
                stack.enter_context(torch.cuda.stream(stream))
            yield
