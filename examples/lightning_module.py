"""A LightningModule trained with DDP, every rank with its own batch size, exactly.

Run (CPU ranks use gloo; GPUs NCCL):

    evendp launch --nproc 2 --batch-sizes 1,3 examples/lightning_module.py
    python examples/lightning_module.py      # one process, 16 samples a step

Three changes against a plain Lightning script: train_dataloader returns
evendp.integrations.lightning.uneven_dataloader(...), training_step returns the loss SUMMED
over its samples, and the Trainer gets use_distributed_sampler=False and the UnevenGradient
callback. The gradient of every optimizer step (accumulate_grad_batches=2 here) is then the
mean over all the step's samples on all ranks.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import evendp
from evendp.integrations.lightning import UnevenGradient, uneven_dataloader


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(1000, 16, generator=g)
        data = TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(dim=1))
        world = self.trainer.world_size  # EVENDP_BATCH_SIZES from `evendp launch`, else 16 each
        return uneven_dataloader(data, evendp.batch_sizes_from_env(world, default=[16] * world))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        local_sum = F.cross_entropy(self.net(x), y, reduction="sum")  # a sum, not a mean
        self.log("loss", evendp.global_mean(local_sum, len(y)), prog_bar=True)
        return local_sum

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),  # torchrun's ranks on this node
        strategy="ddp",
        max_epochs=3,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,  # keep evendp's batch sampler as it is
        callbacks=[UnevenGradient()],
        logger=False,
        enable_checkpointing=False,
    )
    trainer.fit(Classifier())
    if trainer.is_global_zero:
        print(f"final loss {trainer.callback_metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
