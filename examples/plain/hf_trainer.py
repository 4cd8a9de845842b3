"""Fine-tune a tiny GPT-2 with the Hugging Face Trainer, as people write it (even batches).

The plain version of examples/hf_trainer.py, kept to measure what the port changes:

    torchrun --nproc-per-node 2 examples/plain/hf_trainer.py
    python examples/plain/hf_trainer.py            # one process

The model is built from a config: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Sequences(torch.utils.data.Dataset):
    """Variable-length counting sequences (t, t+1, t+2, ... mod 63, plus 1): easy to learn."""

    def __init__(self, n: int) -> None:
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


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    config.resid_pdrop = config.embd_pdrop = config.attn_pdrop = 0.0  # dropout off
    return GPT2LMHeadModel(config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--out", type=Path, help="save each rank's final parameters here")
    cli = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="evendp-hf-") as output_dir:  # nothing is saved
        train(cli, output_dir)


def train(cli: argparse.Namespace, output_dir: str) -> None:
    model = make_model()
    args = TrainingArguments(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        optim="sgd",
        learning_rate=0.5,
        logging_steps=4,
        train_sampling_strategy="sequential",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
    )
    trainer = Trainer(model, args, train_dataset=Sequences(cli.samples), data_collator=pad)
    output = trainer.train()
    if trainer.is_world_process_zero():
        samples_per_s = output.metrics["train_samples_per_second"]
        print(f"train loss {output.training_loss:.4f}, {samples_per_s} samples/s")
    if cli.out is not None:
        torch.save(model.state_dict(), cli.out / f"hf{args.process_index}.pt")


if __name__ == "__main__":
    main()
