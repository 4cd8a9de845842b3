"""The end of an HF run drops the Trainer's DDP wrappers and settles the group, and pays a full
garbage collection only when a dropped wrapper sits in a reference cycle (issue 37: the
collection was most of ``UnevenTrainer.train()``'s extra ~0.7 s over the plain Trainer)."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from evendp import init_distributed
from evendp.integrations._teardown import release_wrappers


def _trainer(cycle: bool) -> tuple[SimpleNamespace, weakref.ref[Any]]:
    """What ``release_wrappers`` reads of an HF Trainer, its wrapper prepared by Accelerate."""
    model = torch.nn.Linear(4, 2)
    wrapper = DistributedDataParallel(model)
    wrapper(torch.randn(3, 4)).sum().backward()
    if cycle:
        wrapper.__dict__["keeps"] = [wrapper]  # freed only by the collector
    accelerator = SimpleNamespace(_models=[wrapper])
    return SimpleNamespace(model=model, model_wrapped=wrapper, accelerator=accelerator), (
        weakref.ref(wrapper)
    )


@pytest.mark.parametrize("cycle", [False, True], ids=["refcount", "cycle"])
def test_wrappers_are_freed_with_a_collection_only_when_in_a_cycle(
    cycle: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    init_distributed("gloo", store=dist.HashStore(), rank=0, world_size=1)
    _trainer(cycle=False)  # one-off imports (torch._dynamo's first use leaves a frame cycle)
    gc.collect()
    collections: list[Any] = []
    real_collect = gc.collect

    def collect(*args: Any) -> int:
        collections.append(args)
        return real_collect(*args)

    monkeypatch.setattr(gc, "collect", collect)
    gc.disable()  # no automatic collection may free the cycle for us
    try:
        trainer, wrapper = _trainer(cycle)
        release_wrappers(trainer)
    finally:
        gc.enable()
    assert wrapper() is None  # no wrapper holds the group once the run is over
    assert trainer.model_wrapped is trainer.model and trainer.accelerator._models == []
    assert len(collections) == (1 if cycle else 0)
    assert dist.is_initialized()  # settled, not ended: whoever ends the run ends it
