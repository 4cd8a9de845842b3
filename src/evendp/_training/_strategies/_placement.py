"""Where the Trainer's model sits: on the first device it runs on, moved there when it is not.

The HF Trainer, Lightning and Accelerate move the model themselves; so does the Trainer, and
it says so in one line. A model on ``meta`` holds shapes and no values: moving it would
train uninitialized memory, so it is refused with the fix. (``BalancedDataParallel`` keeps
``nn.DataParallel``'s rule: the module must already sit on ``device_ids[0]``.)
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from ..._core._errors import EvendpError

__all__ = ["place_model"]


def place_model(model: nn.Module, device: torch.device, where: str, *, say: bool = True) -> None:
    """Move ``model`` in place to ``device`` (``where`` names it for the line said on stderr
    when ``say``) unless every parameter and buffer already sits there.

    Between the CPU and a GPU the parameters stay the same objects (``nn.Module.to`` moves
    their data in place), so an optimizer built on them before keeps working.

    >>> net = nn.Linear(2, 2)
    >>> place_model(net, torch.device("meta"), "device_ids[0]", say=False)
    >>> net.weight.device
    device(type='meta')
    >>> place_model(net, torch.device("cpu"), "device_ids[0]")
    Traceback (most recent call last):
    ...
    evendp.InputError: the model's tensors are on the meta device ...
    """
    away = sorted({str(t.device) for t in _tensors(model) if not _on(t.device, device)})
    if not away:
        return
    if "meta" in away:
        raise EvendpError(
            f"the model's tensors are on the meta device (shapes, no values), so there is "
            f"nothing to move to {device} ({where}); give it its weights first, e.g. "
            f"model.to_empty(device={str(device)!r}) then model.load_state_dict(...), or "
            "build it on a real device"
        )
    model.to(device)
    if say:
        print(
            f"evendp: the model was on {', '.join(away)}; moved it to {device} ({where})",
            file=sys.stderr,
            flush=True,
        )


def _tensors(model: nn.Module) -> list[torch.Tensor]:
    return [*model.parameters(), *model.buffers()]


def _on(device: torch.device, target: torch.device) -> bool:
    """Whether a tensor on ``device`` sits on ``target`` (``cuda`` is the current device)."""
    if device.type != target.type:
        return False
    if device.type != "cuda" or target.index is None:
        return True
    return device.index == target.index
