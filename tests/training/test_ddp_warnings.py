"""evendp's own DDP construction raises no torch deprecation warning (torch 2.13 deprecates
``broadcast_buffers``), and the buffers still are not broadcast before each forward."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from evendp._distributed._group import finish_distributed, init_distributed
from evendp._training._trainer import TrainConfig, Trainer
from tests.training.test_trainer import TinyLM, _data


def test_a_ddp_run_warns_nothing_from_torch() -> None:
    init_distributed("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        cfg = TrainConfig(steps=1, batch_sizes=[4], oom_resplit=False, progress=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            trainer = Trainer(TinyLM(batchnorm=True), _data(), cfg)
            trainer.fit()
        ddp = trainer.wrapped
        assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        synced = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None))
        assert synced is False  # rank-local BatchNorm statistics, as before
    finally:
        finish_distributed()
