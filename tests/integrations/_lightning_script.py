"""Run by test_lightning.py under ``evendp launch``: Lightning DDP on gloo, sizes from the launcher.

Usage: evendp launch --nproc 2 --batch-sizes 1,3 tests/integrations/_lightning_script.py OUT_DIR
(the tests run it from _launched.py, in one launch with the ports of examples/).
Each rank saves the sample indices of its batches and its final parameters to OUT_DIR/rankR.pt:
at the top level for ``training_step`` returning a sum (``reduction="sum"``), under ``"mean"``
and ``"zero"`` for the usual mean, with an empty share in the short last step of 9 samples and
with sizes [0, 4]; there the model refuses 0 rows, as GPT-2 does.
"""

from __future__ import annotations

import os
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


def fit_scheduled_and_validated(data: Any, model: torch.nn.Module) -> dict:
    """A linear decay over ``trainer.estimated_stepping_batches`` stepped every optimizer
    step, and the validation loss of the 9 samples logged with ``logged_count`` (issue 36)."""
    import lightning.pytorch as pl

    from evendp.integrations.lightning import UnevenGradient, logged_count, uneven_dataloader

    nine = torch.utils.data.Subset(Data(), range(9))
    lrs: list[float] = []

    class Rates(pl.Callback):
        def on_before_optimizer_step(self, trainer: Any, module: Any, optimizer: Any) -> None:
            lrs.append(optimizer.param_groups[0]["lr"])

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, _ = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y, _ = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("val_loss", loss, batch_size=logged_count(batch), sync_dist=True)

        def configure_optimizers(self) -> Any:
            optimizer = torch.optim.SGD(self.parameters(), lr=LR)
            total = self.trainer.estimated_stepping_batches
            decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: 1 - k / total)
            return {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": decay, "interval": "step"},
            }

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return uneven_dataloader(data, seed=SEED)

        def val_dataloader(self) -> torch.utils.data.DataLoader:
            return uneven_dataloader(nine, shuffle=False)

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS,
        accumulate_grad_batches=ACCUM, use_distributed_sampler=False, num_sanity_val_steps=0,
        check_val_every_n_epoch=EPOCHS, callbacks=[UnevenGradient(), Rates()],
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    with torch.no_grad():  # every row once, with the trained model: one process's figure
        x = torch.stack([nine[i][0] for i in range(9)])
        y = torch.stack([nine[i][1] for i in range(9)])
        want = float(F.cross_entropy(module.net(x), y))
    return {
        "lrs": lrs,
        "estimated": int(trainer.estimated_stepping_batches),
        "val_loss": float(trainer.callback_metrics["val_loss"]),
        "val_loss_of_every_row": want,
    }


# Lightning's examples/pytorch/basics/transformer.py in miniature (issue 51): its demo
# Transformer, blocks of tokens, loaders built in main() before fit starts the group,
# gradient_clip_val=0.25, SGD 0.1, "train_loss" and "val_loss" logged.
BLOCKS, BLOCK, VOCAB, CLIP = 14, 5, 17, 0.25
VAL = 6  # the last 6 blocks validate (steps of 4 and 2 rows); the first 8 train


class Blocks(torch.utils.data.Dataset):
    """WikiText2's items: (tokens, the same tokens one ahead), ``BLOCK`` long."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(11)
        self.tokens = torch.randint(0, VOCAB, (BLOCKS * BLOCK + 1,), generator=g)

    def __len__(self) -> int:
        return BLOCKS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * BLOCK : (i + 1) * BLOCK + 1]
        return chunk[:-1], chunk[1:]


def tiny_transformer() -> torch.nn.Module:
    from lightning.pytorch.demos import Transformer

    torch.manual_seed(0)
    return Transformer(vocab_size=VOCAB, ninp=8, nhead=2, nhid=16, nlayers=1, dropout=0.0)


def transformer_loaders() -> tuple[Any, Any]:
    """What transformer.py's main() builds before fit, ported: no process group yet. The
    validation loader is built as Lightning's own launcher's first process builds it, without
    ``RANK``/``WORLD_SIZE`` (so as rank 0 of ``[1, 3]`` on both ranks, until fit)."""
    from evendp.integrations.lightning import uneven_dataloader

    data = Blocks()
    train = torch.utils.data.Subset(data, range(BLOCKS - VAL))
    val = torch.utils.data.Subset(data, range(BLOCKS - VAL, BLOCKS))
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        val_loader = uneven_dataloader(val, shuffle=False)
    finally:
        os.environ.update(saved)
    return uneven_dataloader(train, seed=SEED), val_loader


def fit_transformer(loaders: tuple[Any, Any], clip: float | None, max_steps: int = -1) -> dict:
    """transformer.py's LanguageModel and Trainer on loaders built before fit; the first
    optimizer step's gradients as the optimizer sees them (after clipping)."""
    import lightning.pytorch as pl

    from evendp.integrations.lightning import UnevenGradient, logged_count

    grads: list[list[torch.Tensor]] = []

    class LanguageModel(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = tiny_transformer()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            inputs, target = batch
            output = self.model(inputs, target)
            return F.nll_loss(output, target.view(-1))  # "train_loss": UnevenGradient logs it

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            inputs, target = batch
            loss = F.nll_loss(self.model(inputs, target), target.view(-1))
            self.log("val_loss", loss, batch_size=logged_count(batch), sync_dist=True)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

            def first(opt: Any, *_: Any) -> None:
                if not grads:
                    grads.append([p.grad.detach().clone() for p in self.model.parameters()])

            optimizer.register_step_post_hook(first)  # after the closure and the clipping
            return optimizer

    module = LanguageModel()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS, max_steps=max_steps,
        gradient_clip_val=clip, use_distributed_sampler=False, num_sanity_val_steps=0,
        callbacks=[UnevenGradient(log_name="train_loss")], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module, *loaders)
    metrics = trainer.callback_metrics
    return {
        "grads": grads[0],
        "params": [p.detach().clone() for p in module.model.parameters()],
        "train_loss": float(metrics["train_loss"]),
        "val_loss": float(metrics["val_loss"]) if "val_loss" in metrics else None,
        "names": sorted(metrics),
    }


def main_transformer(out: Path, loaders: tuple[Any, Any]) -> None:
    """Both fits of transformer.py's pattern: clipped (to the end) and unclipped (one step)."""
    result = {"clip": fit_transformer(loaders, CLIP), "free": fit_transformer(loaders, None, 1)}
    torch.save(result, out / f"transformer{torch.distributed.get_rank()}.pt")


def main(out: Path) -> None:
    torch.set_num_threads(1)
    result = fit("sum", Data(), None, make_model())
    nine = torch.utils.data.Subset(Data(), range(9))  # steps of 4, 4, 1: the last is [0, 1]
    result["mean"] = fit("mean", nine, None, RejectsEmpty())
    result["zero"] = fit("mean", Data(), [0, 4], RejectsEmpty())
    result["scheduled"] = fit_scheduled_and_validated(Data(), make_model())
    torch.save(result, out / f"rank{torch.distributed.get_rank()}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
