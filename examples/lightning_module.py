"""A LightningModule trained with DDP, every rank with its own batch size, exactly.

Run (CPU ranks use gloo; GPUs NCCL):

    evendp launch --nproc 2 --batch-sizes 1,3 examples/lightning_module.py
    python examples/lightning_module.py      # one process, 8 samples a batch

The port of examples/plain/lightning_module.py (the changed lines: docs/integrations.md):
train_dataloader returns evendp's uneven_dataloader, training_step still returns the usual
mean, and the Trainer gets use_distributed_sampler=False and the UnevenGradient callback,
which also logs the global batch's mean loss as "loss" (so training_step no longer logs the
rank's own). The gradient of every optimizer step (accumulate_grad_batches=2 here) is the mean
over all the step's samples on all ranks.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from evendp.integrations.lightning import UnevenGradient, uneven_dataloader


class Classifier(pl.LightningModule):
    def __init__(self, samples: int) -> None:
        super().__init__()
        self.samples = samples
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))

    def train_dataloader(self) -> DataLoader:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(self.samples, 16, generator=g)
        data = TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(dim=1))
        return uneven_dataloader(data, batch_size=8)  # or EVENDP_BATCH_SIZES

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, help="save each rank's final parameters here")
    cli = parser.parse_args(argv)

    torch.manual_seed(0)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's ranks on this node
    module = Classifier(cli.samples)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        max_epochs=cli.epochs,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,  # keep evendp's batch sampler as it is
        callbacks=[UnevenGradient()],  # also logs the global "loss"
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    if trainer.is_global_zero and "loss" in trainer.callback_metrics:
        print(f"final loss {trainer.callback_metrics['loss']:.4f}")
    if cli.out is not None:
        torch.save(module.net.state_dict(), cli.out / f"lightning{trainer.global_rank}.pt")


if __name__ == "__main__":
    main()
