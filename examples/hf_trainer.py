"""Fine-tune a tiny GPT-2 with the Hugging Face Trainer, every rank with its own batch size.

Run (CPU ranks use gloo; GPUs NCCL):

    evendp launch --nproc 2 --batch-sizes 1,3 examples/hf_trainer.py
    python examples/hf_trainer.py            # one process, per_device_train_batch_size

Rank r takes batch_sizes[r] sequences per forward pass (EVENDP_BATCH_SIZES, set by
`evendp launch`); with gradient_accumulation_steps=2 one optimizer step covers
2 * sum(batch_sizes) sequences, and its gradient is the mean over all their non-padding tokens,
as if one device had run them all. The model is built from a config: nothing is downloaded.
"""

from __future__ import annotations

import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from evendp.integrations.transformers import UnevenTrainer

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Sequences(torch.utils.data.Dataset):
    """Variable-length counting sequences (t, t+1, t+2, ... mod 63, plus 1): easy to learn."""

    def __init__(self, n: int = 256) -> None:
        g = torch.Generator().manual_seed(0)
        self.starts = torch.randint(0, 63, (n,), generator=g).tolist()
        self.lengths = torch.randint(4, 25, (n,), generator=g).tolist()

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = (torch.arange(self.lengths[i]) + self.starts[i]) % 63 + 1  # 0 is padding
        return {"input_ids": ids}


def pad(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sequence; padding is ignored by attention and by the loss."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = f["input_ids"]
        labels[row, : len(f["input_ids"])] = f["input_ids"]
    return {"input_ids": ids, "attention_mask": (labels != -100).long(), "labels": labels}


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="evendp-hf-"),
        per_device_train_batch_size=4,  # only the default when EVENDP_BATCH_SIZES is unset
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        learning_rate=3e-3,
        logging_steps=8,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = UnevenTrainer(model, args, train_dataset=Sequences(), data_collator=pad)
    if trainer.is_world_process_zero():
        print(
            f"batch sizes per rank {trainer.batch_sizes}, "
            f"{trainer.get_total_train_batch_size(args)} sequences per optimizer step"
        )
    output = trainer.train()
    if trainer.is_world_process_zero():
        print(
            f"train loss {output.training_loss:.4f}, "
            f"{output.metrics['train_samples_per_second']} samples/s"
        )


if __name__ == "__main__":
    main()
