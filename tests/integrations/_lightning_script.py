"""Run by test_lightning.py under ``evendp launch``: Lightning DDP on gloo, sizes from the launcher.

Usage: evendp launch --nproc 2 --batch-sizes 1,3 tests/integrations/_lightning_script.py OUT_DIR
(the tests run it from _launched.py, in one launch with the ports of examples/).
Each rank saves the sample indices of its batches and its final parameters to OUT_DIR/rankR.pt:
at the top level for ``training_step`` returning a sum (``reduction="sum"``), under ``"mean"``
and ``"zero"`` for the usual mean, with an empty share in the short last step of 9 samples and
with sizes [0, 4]; there the model refuses 0 rows, as GPT-2 does.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import evendp
from tests.integrations._tiny import ACCUM, EPOCHS, LR, SEED, Data, RejectsEmpty, make_model


def fit(reduction: str, data: Any, sizes: list[int] | None, model: torch.nn.Module) -> dict:
    import lightning.pytorch as pl

    from evendp.integrations.lightning import UnevenGradient, uneven_dataloader

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model
            self.seen: list[list[list[int]]] = []

        def on_train_epoch_start(self) -> None:
            self.seen.append([])

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, idx = batch
            self.seen[-1].append([] if evendp.is_stand_in(batch) else idx.tolist())
            return F.cross_entropy(self.net(x), y, reduction=reduction)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return uneven_dataloader(data, sizes, seed=SEED)  # None: EVENDP_BATCH_SIZES

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUM,
        use_distributed_sampler=False,
        callbacks=[UnevenGradient(reduction=reduction)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    params = [p.detach().clone() for p in module.net.parameters()]
    loss = float(trainer.callback_metrics["loss"])  # the last step's, logged by the callback
    return {"world": trainer.world_size, "seen": module.seen, "params": params, "loss": loss}


def main(out: Path) -> None:
    torch.set_num_threads(1)
    result = fit("sum", Data(), None, make_model())
    nine = torch.utils.data.Subset(Data(), range(9))  # steps of 4, 4, 1: the last is [0, 1]
    result["mean"] = fit("mean", nine, None, RejectsEmpty())
    result["zero"] = fit("mean", Data(), [0, 4], RejectsEmpty())
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
