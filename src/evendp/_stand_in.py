"""The stand-in batch: one real sample that runs an empty share's forward with weight exactly 0.

A rank (or device) whose share of a step is empty must still run forward and backward, so that
the collectives of DDP/FSDP2 match on every rank. A batch of 0 rows would do for a linear
layer, but many real models cannot forward one (GPT-2: "cannot reshape tensor of 0
elements"; BERT's attention mask), so the collate gives one *real* sample instead, marked as a
stand-in. The loss side recognises the mark and gives that sample weight exactly 0 (its count
is 0, its loss a connected zero), so the gradient and the logged loss are those of the real
samples alone.

The mark must survive what the frameworks do to a batch between the collate and the loss:
Hugging Face ``Trainer._prepare_inputs``, Accelerate's ``send_to_device``, Lightning's
``move_data_to_device``, DDP's input moves, ``pin_memory`` and worker processes (pickling)
all rebuild containers and call ``Tensor.to``. So the mark sits on every tensor of the batch:
each is a :class:`StandInTensor`, a ``torch.Tensor`` subclass that stays one through moves and
copies (``to``, ``cuda``, ``cpu``, ``pin_memory``, ``clone``, ``detach``, ``contiguous``,
pickling) and through nothing else: any computation on it returns a plain tensor, so the model
itself never sees the subclass past its first operation.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

__all__ = ["StandInTensor", "is_stand_in", "stand_in_batch", "zero_weight"]


class StandInTensor(torch.Tensor):
    """A tensor of a stand-in batch; moves and copies keep the mark, computations drop it.

    >>> t = torch.ones(1, 3).as_subclass(StandInTensor)
    >>> type(t.to(torch.float64)).__name__, type(t * 2).__name__, type(t[:, 1:]).__name__
    ('StandInTensor', 'Tensor', 'Tensor')
    """

    @classmethod
    def __torch_function__(
        cls,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func in _MOVES and isinstance(out, torch.Tensor):
            return out.as_subclass(cls)
        return out

    def __deepcopy__(self, memo: dict[int, Any]) -> StandInTensor:
        copied = memo.get(id(self))
        if copied is None:
            copied = memo[id(self)] = self.clone()
        return copied  # type: ignore[return-value]


# The operations that move or copy a batch without computing on it: the mark goes along.
_MOVES = {
    torch.Tensor.to,
    torch.Tensor.cuda,
    torch.Tensor.cpu,
    torch.Tensor.pin_memory,
    torch.Tensor.clone,
    torch.Tensor.detach,
    torch.Tensor.contiguous,
    torch.Tensor.share_memory_,
}


def stand_in_batch(batch: Any) -> Any:
    """``batch`` (a collated batch of one real sample) with every tensor marked as a stand-in.

    Containers keep their type (dicts, ``BatchEncoding``-like mappings, lists, tuples,
    namedtuples); non-tensor leaves stay as they are.

    >>> x, y = stand_in_batch((torch.ones(1, 3), torch.tensor([2])))
    >>> is_stand_in(x), is_stand_in(y), x.shape
    (True, True, torch.Size([1, 3]))
    """
    if isinstance(batch, torch.Tensor):
        return batch.as_subclass(StandInTensor)
    if isinstance(batch, Mapping):
        items = {k: stand_in_batch(v) for k, v in batch.items()}
        try:
            return type(batch)(items)  # type: ignore[call-arg]
        except TypeError:  # a mapping that cannot be built from a dict
            return items
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(stand_in_batch(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(stand_in_batch(v) for v in batch)
    return batch


def is_stand_in(batch: Any) -> bool:
    """Whether ``batch`` (a tensor or a nested batch) is a stand-in: its first tensor is marked.

    >>> is_stand_in({"input_ids": torch.ones(2, 4)}), is_stand_in([None, 3])
    (False, False)
    """
    tensor = _first_tensor(batch)
    return isinstance(tensor, StandInTensor)


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(values, (list, tuple)) or isinstance(batch, Mapping):
        for value in values:
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def zero_weight(loss: torch.Tensor) -> torch.Tensor:
    """``loss`` with weight exactly 0: a zero connected to its graph (0 even if ``loss`` is NaN).

    Backward through it gives every parameter a gradient of exactly 0 when the loss's own
    gradient is finite (a stand-in's is: it is a real sample), so a stand-in joins DDP's
    all-reduce and changes nothing.

    >>> w = torch.tensor(3.0, requires_grad=True)
    >>> out = zero_weight(w * 2)
    >>> out.backward(); out.item(), w.grad.item()
    (0.0, 0.0)
    """
    return torch.where(torch.zeros((), dtype=torch.bool, device=loss.device), loss, 0.0)
