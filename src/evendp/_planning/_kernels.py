"""A fake step planned for a GPU saves what the GPU's kernels save, not what the CPU's would.

The planner runs the step on fake *cpu* tensors. Where the CPU's kernel and the GPU's keep
different tensors for the backward, the CPU's choice would be planned for a GPU. One matters
by far: ``F.scaled_dot_product_attention`` with ``dropout_p > 0`` (HF GPT-2's default
``attn_pdrop=0.1`` while training) takes the *math* path on a CPU (its fused CPU kernel has no
dropout), which saves the ``heads x T x T`` attention matrix and a dropout mask; on a CUDA GPU
the flash and memory-efficient kernels draw dropout inside the kernel and save only the output
and a log-sum-exp per row (PyTorch's SDPA notes, ``torch.nn.attention``). For a GPT-2 124M
at sequence 512 that is about a third of the activations. Under :func:`gpu_kernels` the fake
run calls attention with ``dropout_p=0``: on fake tensors the values never matter, only what
the kernel keeps.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["gpu_kernels"]


class _FusedAttention(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            if len(args) > 4:  # dropout_p given by position: (q, k, v, attn_mask, dropout_p)
                args = (*args[:4], 0.0, *args[5:])
            elif kwargs.get("dropout_p"):
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


@contextmanager
def gpu_kernels(enabled: bool = True) -> Iterator[None]:
    """Within it, attention runs as the GPU's fused kernels would keep it (see the module).

    >>> import torch
    >>> q = torch.randn(1, 2, 8, 4)
    >>> with gpu_kernels():
    ...     out = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
    >>> torch.allclose(out, F.scaled_dot_product_attention(q, q, q))
    True
    """
    if not enabled:
        yield
        return
    with _FusedAttention():
        yield
