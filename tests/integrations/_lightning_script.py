"""Run by test_lightning.py under ``evendp launch``: Lightning DDP on gloo, sizes from the launcher.

Usage: evendp launch --nproc 2 --batch-sizes 1,3 tests/integrations/_lightning_script.py OUT_DIR
Each rank saves the sample indices of its batches and its final parameters to OUT_DIR/rankR.pt.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tests.integrations._tiny import ACCUM, EPOCHS, LR, SEED, Data, make_model


def main(out: Path) -> None:
    import lightning.pytorch as pl

    from evendp.integrations.lightning import UnevenGradient, uneven_dataloader

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model()
            self.seen: list[list[list[int]]] = []

        def on_train_epoch_start(self) -> None:
            self.seen.append([])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, idx = batch
            self.seen[-1].append(idx.tolist())
            return F.cross_entropy(self.net(x), y, reduction="sum")  # a sum, not a mean

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return uneven_dataloader(Data(), seed=SEED)  # sizes from EVENDP_BATCH_SIZES

    torch.set_num_threads(1)
    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUM,
        use_distributed_sampler=False,
        callbacks=[UnevenGradient()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    params = [p.detach().clone() for p in module.net.parameters()]
    result = {"world": trainer.world_size, "seen": module.seen, "params": params}
    torch.save(result, out / f"rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
