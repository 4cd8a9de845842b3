"""Ranks never fall out of step on degenerate batches (issue 25): every rank runs the same
collectives, so a run ends, and its parameters equal one process on the same global batches.

One spawn of 2 gloo ranks drives ``UnevenTrainer`` on causal-LM batches whose counted tokens
vary by rank: 1-token sequences (nothing left after the causal shift), all-padding rows
(every label -100), a rank whose first batch counts nothing, and an empty share (a stand-in).
The loss-kwargs probe must reach one verdict on every rank; decided locally, rank 0 would
enter evendp's all-reduce and rank 1 the Trainer's all-gather (a deadlock: here a gloo
timeout, so the test fails instead of hanging).
"""

from __future__ import annotations

import datetime
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

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


def _worker(rank: int, port: int, out: str) -> None:
    torchrun_env(rank, 2, port)
    import evendp
    from evendp.integrations.transformers import UnevenTrainer

    # Before the Trainer starts it: the group times out a deadlocked collective.
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    evendp.init_distributed("gloo", timeout=timeout)
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case, (_, _, sizes, accum) in CASES.items():
            model = _model()
            args = _args(tmp, 2, accum, ddp_backend="gloo")
            trainer = UnevenTrainer(
                model, args, train_dataset=_Data(case), data_collator=_pad, batch_sizes=sizes
            )
            output = trainer.train()
            result[case] = {"params": _params(model), "steps": output.global_step}
    torch.save(result, Path(out) / f"rank{rank}.pt")
    evendp.finish_distributed()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
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
    ranks: list[dict[str, Any]], case: str
) -> None:
    start, want = _params(_model()), _reference(case)
    num_den = [0.0, 0.0]
    for rank in ranks:
        got = rank[case]
        assert got["steps"] == EPOCHS  # one optimizer step per epoch: all 8 samples
        num_den[0] = sum(float((got["params"][k] - want[k]).norm() ** 2) for k in want) ** 0.5
        num_den[1] = sum(float((want[k] - start[k]).norm() ** 2) for k in want) ** 0.5
        assert num_den[1] > 0 and num_den[0] / num_den[1] < TOL
