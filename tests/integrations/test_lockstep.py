"""Ranks never fall out of step on degenerate batches (issue 25): every rank runs the same
collectives, so a run ends, and its parameters equal one process on the same global batches.

One spawn of 2 gloo ranks drives every DDP surface in turn on causal-LM batches whose
counted tokens vary by rank: 1-token sequences (nothing left after the causal shift),
all-padding rows (every label -100), a rank whose first batch counts nothing, and an empty
share (a stand-in). The surfaces: ``UnevenTrainer``, evendp's own ``Trainer`` (token
``count_fn``), Lightning's ``UnevenGradient`` (token ``count_fn``) and ``UnevenAccelerator``
(its weights count samples, so its loss is a per-sample mean); DeepSpeed's run in
test_deepspeed.py. The loss-kwargs probe must reach one verdict on every rank; decided
locally, rank 0 would enter evendp's all-reduce and rank 1 the Trainer's all-gather (a
deadlock: here a gloo timeout, so the test fails instead of hanging).
"""

from __future__ import annotations

import datetime
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests._helpers import run_ranks, tiny_gpt2_config, torchrun_env

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")

TOL = 1e-5
#: A collective waiting longer than this is a deadlock: gloo raises on the waiting rank.
COLLECTIVE_TIMEOUT_S = 60

#: case -> (sequence lengths, labels all -100 at these indices, batch sizes, accumulation).
#: "issue": the report's eight sequences; with seed 0 rank 0's first batch is the 1-token one.
#: "empty": rank 0 always empty (a stand-in), rank 1's first batch counts only an all-padding
#: row and 1-token sequences besides one counted row.
CASES: dict[str, tuple[list[int], list[int], list[int], int]] = {
    "issue": ([5, 12, 3, 9, 1, 12, 7, 4], [], [1, 3], 2),
    "empty": ([1, 6, 1, 4, 8, 1, 3, 9], [1, 7], [0, 4], 2),
}
EPOCHS = 2
LR = 0.5
#: Each surface's shuffle seed, chosen so that rank 0's first batch of the "issue" case is the
#: 1-token sequence (which counts nothing after the causal shift), as with UnevenTrainer.
SEEDS = {"evendp": 0, "lightning": 0, "accelerate": 0}


class _Data(torch.utils.data.Dataset):
    def __init__(self, case: str) -> None:
        lengths, ignored, _, _ = CASES[case]
        g = torch.Generator().manual_seed(5)
        self.items = []
        for i, n in enumerate(lengths):
            ids = torch.randint(1, 64, (n,), generator=g)
            labels = torch.full_like(ids, -100) if i in ignored else ids.clone()
            self.items.append({"input_ids": ids, "labels": labels})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def _pad(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        n = len(f["input_ids"])
        ids[row, :n], labels[row, :n], mask[row, :n] = f["input_ids"], f["labels"], 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(tiny_gpt2_config())


def _args(out: str, batch: int, accum: int, **extra: Any) -> Any:
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
        num_train_epochs=EPOCHS, learning_rate=0.5, optim="sgd", lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=0.0, report_to="none", save_strategy="no",
        logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0, **extra,
    )  # fmt: skip


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _lengths(batch: dict[str, torch.Tensor]) -> list[int]:
    """The unpadded lengths of a batch's rows (what a rank trained on, for the checks)."""
    import evendp

    return [] if evendp.is_stand_in(batch) else batch["attention_mask"].sum(1).tolist()


def _sample_mean(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's summed token loss, averaged over the batch's rows: a per-sample mean,
    what ``UnevenAccelerator`` weighs exactly (it counts samples, not tokens)."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:].reshape(-1)
    total = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets, reduction="sum")
    return total / len(batch["input_ids"])


def _uneven_trainer(case: str, tmp: str) -> dict[str, Any]:
    from evendp.integrations.transformers import UnevenTrainer

    _, _, sizes, accum = CASES[case]
    model = _model()
    args = _args(tmp, 2, accum, ddp_backend="gloo")
    trainer = UnevenTrainer(
        model, args, train_dataset=_Data(case), data_collator=_pad, batch_sizes=sizes
    )
    output = trainer.train()
    return {"params": _params(model), "steps": output.global_step}


def _evendp_trainer(case: str) -> dict[str, Any]:
    """evendp's own Trainer under DDP: a step's share is cut into ``accum`` micro-batches, so
    the per-step sizes are the micro-batch sizes times ``accum`` (one step: the 8 samples)."""
    import evendp

    _, _, sizes, accum = CASES[case]
    model = _model()
    seen: list[list[int]] = []

    def collate(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        batch = _pad(features)
        seen.append(_lengths(batch))
        return batch

    config = evendp.TrainConfig(
        steps=EPOCHS, batch_size=8, batch_sizes=[s * accum for s in sizes], accum=accum,
        grad_clip=None, progress=False, seed=SEEDS["evendp"], comm_timeout=COLLECTIVE_TIMEOUT_S,
    )  # fmt: skip
    trainer = evendp.Trainer(
        model, _Data(case), config, count_fn=evendp.count_tokens(shift=True),
        optimizer=torch.optim.SGD(model.parameters(), lr=LR), collate_fn=collate,
    )  # fmt: skip
    report = trainer.fit()
    return {"params": _params(model), "steps": report.steps, "seen": seen}


def _lightning(case: str) -> dict[str, Any]:
    """Lightning's DDP on the started group: ``UnevenGradient`` with the token count."""
    import lightning.pytorch as pl

    import evendp
    from evendp.integrations.lightning import UnevenGradient, uneven_dataloader

    _, _, sizes, accum = CASES[case]
    model = _model()

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = model
            self.seen: list[list[int]] = []

        def training_step(self, batch: dict[str, torch.Tensor], idx: int) -> torch.Tensor:
            self.seen.append(_lengths(batch))
            return self.net(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return uneven_dataloader(_Data(case), sizes, collate_fn=_pad, seed=SEEDS["lightning"])

    module = Module()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_epochs=EPOCHS,
        accumulate_grad_batches=accum, use_distributed_sampler=False, logger=False,
        callbacks=[UnevenGradient(reduction="mean", count_fn=evendp.count_tokens(shift=True))],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(module)
    return {"params": _params(model), "steps": trainer.global_step, "seen": module.seen}


def _accelerate(case: str) -> dict[str, Any]:
    """``UnevenAccelerator`` as docs/integrations.md uses it, on a per-sample mean loss."""
    from evendp.integrations.accelerate import UnevenAccelerator, uneven_dataloader

    _, _, sizes, accum = CASES[case]
    accelerator = UnevenAccelerator(cpu=True, gradient_accumulation_steps=accum)
    loader = uneven_dataloader(
        accelerator, _Data(case), sizes, collate_fn=_pad, seed=SEEDS["accelerate"]
    )
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    wrapped, optimizer = accelerator.prepare(model, optimizer)
    seen, steps = [], 0
    for _ in range(EPOCHS):
        for batch in loader:
            seen.append(_lengths(batch))
            with accelerator.accumulate(wrapped):
                accelerator.backward(_sample_mean(wrapped, batch))
                steps += accelerator.sync_gradients
                optimizer.step()
                optimizer.zero_grad()
    return {"params": _params(model), "steps": steps, "seen": seen}


def _worker(rank: int, port: int, out: str) -> None:
    torchrun_env(rank, 2, port)
    import evendp

    # Before any framework starts it: the group times out a deadlocked collective.
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    evendp.init_distributed("gloo", timeout=timeout)
    result: dict[Any, Any] = {}  # case, or (surface, case)
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            result[case] = _uneven_trainer(case, tmp)
            result["evendp", case] = _evendp_trainer(case)
            result["lightning", case] = _lightning(case)
            result["accelerate", case] = _accelerate(case)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    evendp.finish_distributed()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    out = tmp_path_factory.mktemp("lockstep")
    return run_ranks(_worker, 2, out, 4 * COLLECTIVE_TIMEOUT_S, "the lockstep ranks")


def _reference(case: str) -> dict[str, torch.Tensor]:
    """One plain Trainer process: the whole epoch (one optimizer step) in one forward pass."""
    model = _model()
    with tempfile.TemporaryDirectory() as tmp:
        data = _Data(case)
        trainer = transformers.Trainer(
            model, _args(tmp, len(data), 1), train_dataset=data, data_collator=_pad
        )
        trainer.train()
    return _params(model)


@pytest.mark.parametrize("case", list(CASES))
def test_uneven_trainer_on_degenerate_batches_ends_and_equals_one_process(
    ranks: list[dict[Any, Any]], case: str
) -> None:
    start, want = _params(_model()), _reference(case)
    num_den = [0.0, 0.0]
    for rank in ranks:
        got = rank[case]
        assert got["steps"] == EPOCHS  # one optimizer step per epoch: all 8 samples
        num_den[0] = sum(float((got["params"][k] - want[k]).norm() ** 2) for k in want) ** 0.5
        num_den[1] = sum(float((want[k] - start[k]).norm() ** 2) for k in want) ** 0.5
        assert num_den[1] > 0 and num_den[0] / num_den[1] < TOL


def _one_process(case: str, loss: str) -> dict[str, torch.Tensor]:
    """One process, plain SGD: each epoch (one optimizer step) in one forward pass, the loss
    a mean over the counted tokens (``"tokens"``) or over the 8 sequences (``"samples"``)."""
    model, data = _model(), _Data(case)
    batch = _pad([data[i] for i in range(len(data))])
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(EPOCHS):
        value = model(**batch).loss if loss == "tokens" else _sample_mean(model, batch)
        value.backward()
        optimizer.step()
        optimizer.zero_grad()
    return _params(model)


#: surface -> the loss its run averages: Accelerate's weights count samples (docs).
SURFACES = {"evendp": "tokens", "lightning": "tokens", "accelerate": "samples"}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("surface", list(SURFACES))
def test_every_surface_on_degenerate_batches_ends_and_equals_one_process(
    ranks: list[dict[Any, Any]], surface: str, case: str
) -> None:
    start, want = _params(_model()), _one_process(case, SURFACES[surface])
    moved = sum(float((want[k] - start[k]).norm() ** 2) for k in want) ** 0.5
    for rank in ranks:
        got = rank[surface, case]
        assert got["steps"] == EPOCHS  # one optimizer step per epoch: all 8 samples
        off = sum(float((got["params"][k] - want[k]).norm() ** 2) for k in want) ** 0.5
        assert moved > 0 and off / moved < TOL, (surface, case, off / moved)
    seen = ranks[0][surface, case]["seen"]  # rank 0's batches (evendp's Trainer: step shares)
    if case == "issue":  # rank 0 starts on the 1-token sequence: it counts nothing
        assert seen[0][0] == 1
    elif surface == "evendp":  # no share at all: only its stand-in row was ever collated
        assert seen == [[CASES[case][0][0]]]
    else:  # no sample at all: stand-ins only
        assert all(not lengths for lengths in seen)
