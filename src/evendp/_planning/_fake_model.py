"""The model the planner runs: a copy whose every tensor is a fake *cpu* tensor, wherever the
user's tensors sit (the CPU, a GPU, ``meta``, or fake tensors of another mode).

Each fake tensor is made from its original's shape, strides, dtype and ``requires_grad``
alone: nothing is read from the original, nothing is allocated, and the user's module is
never touched (``nn.Module.to`` or ``_apply`` on it, or on a fake copy of a GPU or ``meta``
tensor, would move the user's model or fail: fake tensors' conversion swaps tensors, which
the fake mode's own references forbid). The planner measures on the CPU because fake
``cuda`` tensors cannot run backward on a machine without a GPU; sizes do not depend on the
device.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["fake_cpu_copy", "off_cpu"]


def off_cpu(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on a device other than the CPU.

    >>> off_cpu(nn.Linear(2, 2)), off_cpu(nn.Linear(2, 2, device="meta"))
    (False, True)
    """
    return any(t.device.type != "cpu" for t in [*model.parameters(), *model.buffers()])


def fake_cpu_copy(model: nn.Module, fake_mode: Any) -> nn.Module:
    """A deep copy of ``model`` whose tensors are new fake cpu tensors of ``fake_mode``.

    Tied parameters stay tied (one fake tensor per original, through the copy's memo).

    >>> from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    >>> on_meta = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8)).to("meta")
    >>> fake = fake_cpu_copy(on_meta, FakeTensorMode())
    >>> sorted({t.device.type for t in fake.state_dict().values()}), on_meta[0].weight.device
    (['cpu'], device(type='meta'))
    >>> all(isinstance(t, FakeTensor) for t in fake.state_dict().values())
    True
    """
    with _FakeCpuCopy(fake_mode):
        return copy.deepcopy(model)


def _fake_like(t: torch.Tensor, fake_mode: Any) -> torch.Tensor:
    """A fake cpu tensor of ``t``'s shape, strides and dtype (read from metadata only): the
    same strides give the same storage size, an expanded tensor's small one too."""
    with fake_mode:
        if t.layout == torch.strided:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
        return torch.empty(t.shape, dtype=t.dtype, device="cpu")


class _FakeCpuCopy(TorchFunctionMode):
    """During ``copy.deepcopy``: every tensor copied becomes a fake cpu tensor.

    ``nn.Parameter.__deepcopy__`` copies through ``clone``; a plain tensor (a buffer, or a
    tensor kept as a module attribute) through ``Tensor.__deepcopy__``. Both are caught here
    and answered from the original's metadata; any other function runs as it would.
    """

    def __init__(self, fake_mode: Any) -> None:
        super().__init__()
        self.fake_mode = fake_mode

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch._C.TensorBase.clone:  # inside nn.Parameter.__deepcopy__
            return _fake_like(args[0], self.fake_mode)
        if func is torch.Tensor.__deepcopy__:
            tensor, memo = args
            if id(tensor) not in memo:
                fake = _fake_like(tensor, self.fake_mode)
                if tensor.requires_grad and tensor.is_leaf:
                    fake.requires_grad_(True)
                memo[id(tensor)] = fake
            return memo[id(tensor)]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
