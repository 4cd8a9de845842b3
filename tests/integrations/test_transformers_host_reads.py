"""``UnevenTrainer``'s steady step reads no more tensor values on the host than the HF
``Trainer``'s (issue 50: on one H200 it cost 67.48 ms a step against 64.20 ms).

One process, a tiny GPT-2 from a config with padding and -100 labels, accumulation 2: each
read of a tensor's value (``tests/_host_reads.py``; on a GPU each waits for the device) is
recorded with the optimizer step it happened in, for both trainers on the same data. The
first step (``UnevenTrainer`` asks once whether the loss uses ``num_items_in_batch``, and
checks the counts' values) and the last are left out.
"""

from __future__ import annotations

import tempfile
from collections import Counter
from typing import Any

import pytest
import torch

from tests._helpers import tiny_gpt2_config
from tests._host_reads import HostReads, optimizer_steps

transformers = pytest.importorskip("transformers")

STEPS = 6
STEADY = range(2, STEPS - 1)  # the reads of optimizer steps 3 to 5 (global_step 2 to 4)


class _Rows(torch.utils.data.Dataset):
    """Token rows of 4 to 8 ids, each with a class too."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = torch.Generator().manual_seed(i)
        ids = torch.randint(1, 64, (4 + i % 5,), generator=g)
        return {"input_ids": ids, "labels": i % 3}  # the class (the LM's labels: its ids)


def _collate(task: str) -> Any:
    def collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        longest = max(len(f["input_ids"]) for f in features)
        ids = torch.zeros(len(features), longest, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, f in enumerate(features):
            ids[row, : len(f["input_ids"])], mask[row, : len(f["input_ids"])] = f["input_ids"], 1
        labels = ids.masked_fill(mask == 0, -100)
        if task == "cls":
            labels = torch.tensor([f["labels"] for f in features])
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}

    return collate


def _model(task: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if task == "lm":  # a token loss: the Trainer's own num_items_in_batch path
        return transformers.GPT2LMHeadModel(tiny_gpt2_config())
    model = transformers.GPT2ForSequenceClassification(
        tiny_gpt2_config(num_labels=3, pad_token_id=0)
    )
    model.accepts_loss_kwargs = False  # a per-batch mean: evendp's count path
    return model


def _steady_reads(trainer_class: Any, task: str, **options: Any) -> list[Counter]:
    """Per steady optimizer step: how often each (kind, site) read happened."""
    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            tmp, per_device_train_batch_size=4, gradient_accumulation_steps=2,
            max_steps=STEPS, max_grad_norm=1.0, report_to="none", use_cpu=True,
            disable_tqdm=True, save_strategy="no", logging_strategy="no", seed=0,
        )  # fmt: skip
        trainer = trainer_class(
            _model(task), args, train_dataset=_Rows(), data_collator=_collate(task), **options
        )
        ignore = optimizer_steps(lambda: trainer.optimizer)
        with HostReads(key=lambda: trainer.state.global_step, ignore=ignore) as reads:
            trainer.train()
    return [Counter((r.kind, r.site) for r in reads.where(step)) for step in STEADY]


@pytest.mark.parametrize("task", ["lm", "cls"])
def test_a_steady_step_reads_what_the_hf_trainers_does(task: str) -> None:
    """Issue 50: with a per-batch mean (``cls``) each steady step read the step's count and
    its global count back (``validate_count``: 3 reads a step with accumulation 2; on a GPU
    in one process also a copy of the count to the CPU and back, each waiting for it)."""
    from evendp.integrations.transformers import UnevenTrainer

    want = _steady_reads(transformers.Trainer, task)
    got = _steady_reads(UnevenTrainer, task, batch_sizes=[4])
    assert got == want
