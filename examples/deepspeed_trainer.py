"""Fine-tune a tiny GPT-2 with the HF Trainer and DeepSpeed ZeRO, every rank with its own batch.

Run (CPU ranks use gloo; GPUs NCCL):

    evendp launch --nproc 2 --batch-sizes 1,3 examples/deepspeed_trainer.py
    evendp launch --nproc 2 --batch-sizes 1,3 examples/deepspeed_trainer.py --zero-stage 3

The port of examples/plain/deepspeed_trainer.py (the changed lines: docs/integrations.md).
Rank r takes batch_sizes[r] sequences per forward pass (EVENDP_BATCH_SIZES, set by
`evendp launch`); with gradient_accumulation_steps=2 one optimizer step covers
2 * sum(batch_sizes) sequences, and its gradient is the mean over all their non-padding tokens,
as if one device had run them all, for ZeRO stages 1, 2 and 3; the logged and final losses
are the global batch's. The model is built from a config (nothing is downloaded), after
TrainingArguments, so that ZeRO-3 builds it partitioned (deepspeed.zero.Init).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from evendp.integrations.transformers import UnevenTrainer

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
    parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--save-steps", type=int, default=0, help="a checkpoint every N steps")
    parser.add_argument("--resume", help="a checkpoint folder to resume from")
    parser.add_argument("--output-dir", help="checkpoints (default: a folder removed at the end)")
    cli = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="evendp-ds-") as scratch:
        train(cli, cli.output_dir or scratch)


def train(cli: argparse.Namespace, output_dir: str) -> None:
    deepspeed = {  # what --deepspeed ds_config.json holds; "auto": from TrainingArguments
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": {
            "stage": cli.zero_stage,
            "stage3_gather_16bit_weights_on_model_save": True,  # saved whole
        },
        "zero_allow_untested_optimizer": True,  # torch.optim SGD
    }
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
        save_strategy="steps" if cli.save_steps else "no",
        save_steps=cli.save_steps or 500,
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        deepspeed=deepspeed,
    )
    model = make_model()  # after TrainingArguments: ZeRO-3 builds it partitioned
    trainer = UnevenTrainer(model, args, train_dataset=Sequences(cli.samples), data_collator=pad)
    output = trainer.train(resume_from_checkpoint=cli.resume)
    if trainer.is_world_process_zero():
        samples_per_s = output.metrics["train_samples_per_second"]
        print(f"train loss {output.training_loss:.4f}, {samples_per_s} samples/s")
    if cli.out is not None:  # every rank: ZeRO-3 gathers the parameters
        state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
        torch.save(state, cli.out / f"ds_trainer{args.process_index}.pt")


if __name__ == "__main__":
    main()
