"""Which modules are a model's repeated blocks: the unit of activation checkpointing.

The convention every transformer follows (GPT-2's ``h``, BERT's ``layer``, Llama's
``layers``): the blocks are the children of an ``nn.ModuleList``. The planner measures a
checkpointed step with these blocks and the Trainer checkpoints the same ones, so a plan
describes the program that runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.nn as nn

__all__ = ["block_predicate", "repeated_blocks"]


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of every ``nn.ModuleList`` in ``model``, in module order, each once.

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.ReLU(), nn.Tanh()]))
    >>> [type(m).__name__ for m in repeated_blocks(net)]
    ['ReLU', 'Tanh']
    """
    seen: set[int] = set()
    blocks: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for child in module:
                if id(child) not in seen:
                    seen.add(id(child))
                    blocks.append(child)
    return blocks


def block_predicate(model: nn.Module) -> Callable[[nn.Module], bool]:
    """``check(module)``: whether ``module`` is one of ``model``'s :func:`repeated_blocks`
    (the ``check_fn`` torch's ``apply_activation_checkpointing`` takes).

    >>> net = nn.Sequential(nn.Linear(2, 2), nn.ModuleList([nn.ReLU()]))
    >>> check = block_predicate(net)
    >>> check(net[1][0]), check(net[0])
    (True, False)
    """
    ids = {id(m) for m in repeated_blocks(model)}
    return lambda module: id(module) in ids
