"""TRL's trainers and ``Seq2SeqTrainer`` composed with ``UnevenTrainer``, on tiny local assets.

Usage (the launch of test_trl.py): evendp launch --nproc 2 --batch-sizes 1,3
    tests/integrations/_trl_script.py ASSETS OUT HANG_S [port-only]
Each composed trainer (``class X(UnevenTrainer, SFTTrainer): pass``) trains for two epochs of 9
samples (micro-steps 4, 4, 1: the last leaves rank 0 empty) and saves its parameters to
OUT/<case><rank>.pt; then TRL's own script, ported (examples/trl_sft.py), runs last: it ends
with ``trainer.end()``, which destroys the process group. With ``port-only`` only the port
runs (the exit-code check). The one-process references run the same functions in the test
process with ``EVENDP_BATCH_SIZES=4`` (the same global batches).
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = 9
WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["<pad>", "<unk>", "<eos>", "<bos>"]
#: Training arguments every case shares: SGD, a constant rate, nothing that differs by rank.
COMMON: dict[str, Any] = {
    "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
    "num_train_epochs": 2, "learning_rate": 0.5, "optim": "sgd",
    "lr_scheduler_type": "constant", "weight_decay": 0.0, "max_grad_norm": 0.0,
    "report_to": "none", "save_strategy": "no", "logging_strategy": "no",
    "disable_tqdm": True, "use_cpu": True, "seed": 0, "bf16": False,
}  # fmt: skip


def _text(i: int, n: int) -> str:
    g = torch.Generator().manual_seed(100 + i)
    return " ".join(WORDS[int(k)] for k in torch.randint(0, len(WORDS), (n,), generator=g))


def make_assets(root: Path) -> Path:
    """A word-level tokenizer and a dropout-free GPT-2 saved as a model directory, and the
    datasets (plain text; preference pairs) as JSON lines. Nothing is downloaded."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>",
        bos_token="<bos>",
    )  # fmt: skip
    model_dir = root / "model"
    tokenizer.save_pretrained(model_dir)
    config = transformers.GPT2Config(
        vocab_size=len(vocab), n_positions=32, n_embd=16, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=0, eos_token_id=2,
        bos_token_id=3,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(model_dir)
    lengths = [1, 5, 9, 2, 12, 3, 7, 1, 6]  # 1-word texts: nothing to learn after the shift
    (root / "text").mkdir()
    with open(root / "text" / "train.jsonl", "w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"text": _text(i, n)}) + "\n")
    with open(root / "pairs.jsonl", "w") as f:
        for i in range(SAMPLES):
            row = {"prompt": _text(i, 3), "chosen": _text(50 + i, 2), "rejected": _text(80 + i, 4)}
            f.write(json.dumps(row) + "\n")
    return root


def _load(assets: Path) -> tuple[Any, Any]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(assets / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(assets / "model")
    return model, tokenizer


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def run_sft(assets: Path, out: Path, packing: bool) -> dict[str, torch.Tensor]:
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    from evendp.integrations.transformers import UnevenTrainer

    class UnevenSFTTrainer(UnevenTrainer, SFTTrainer):
        pass

    model, tokenizer = _load(assets)
    data = load_dataset(str(assets / "text"), split="train")
    args = SFTConfig(str(out / "sft"), packing=packing, max_length=16, **COMMON)
    trainer = UnevenSFTTrainer(
        model=model, args=args, train_dataset=data, processing_class=tokenizer
    )
    trainer.train()
    return _params(model)


def run_dpo(assets: Path, out: Path) -> dict[str, torch.Tensor]:
    from datasets import load_dataset
    from trl import DPOConfig, DPOTrainer

    from evendp.integrations.transformers import UnevenTrainer

    class UnevenDPOTrainer(UnevenTrainer, DPOTrainer):
        pass

    model, tokenizer = _load(assets)
    data = load_dataset("json", data_files=str(assets / "pairs.jsonl"), split="train")
    args = DPOConfig(str(out / "dpo"), max_length=16, **COMMON)
    trainer = UnevenDPOTrainer(
        model=model, args=args, train_dataset=data, processing_class=tokenizer
    )
    trainer.train()
    return _params(model)


class _Pairs(torch.utils.data.Dataset):
    """Source and target ids of varying lengths for a tiny T5 (0 is padding)."""

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(200 + i)
        n, m = 2 + i % 5, 1 + (i * 3) % 4
        return {
            "input_ids": torch.randint(1, 40, (n,), generator=g),
            "labels": torch.randint(1, 40, (m,), generator=g),
        }


def pad_pairs(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Right-pad sources with 0 (attention 0) and targets with -100."""
    rows = len(features)
    src = max(len(f["input_ids"]) for f in features)
    tgt = max(len(f["labels"]) for f in features)
    ids, labels = torch.zeros(rows, src, dtype=torch.long), torch.full((rows, tgt), -100)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        n, m = len(f["input_ids"]), len(f["labels"])
        ids[row, :n], mask[row, :n], labels[row, :m] = f["input_ids"], 1, f["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def run_seq2seq(assets: Path, out: Path) -> dict[str, torch.Tensor]:
    import transformers

    from evendp.integrations.transformers import UnevenTrainer

    class UnevenSeq2SeqTrainer(UnevenTrainer, transformers.Seq2SeqTrainer):
        pass

    config = transformers.T5Config(
        vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config)
    # Evaluation batches of 4 rows over all ranks, as in one process with the same arguments.
    evaluation = {"per_device_eval_batch_size": 4, "predict_with_generate": True}
    args = transformers.Seq2SeqTrainingArguments(
        str(out / "s2s"), generation_max_length=5, **evaluation, **COMMON
    )
    trainer = UnevenSeq2SeqTrainer(
        model=model, args=args, train_dataset=_Pairs(), data_collator=pad_pairs
    )
    trainer.train()
    # Issue 36: generated predictions and the loss of the trained model, each row once.
    output = trainer.predict(_Pairs())
    predictions = {"loss": output.metrics["test_loss"], "labels": output.label_ids}
    predictions["generated"] = output.predictions
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: torch.as_tensor(v) for k, v in predictions.items()}, out / "predictions.pt")
    return _params(model)


def t5_start() -> dict[str, torch.Tensor]:
    import transformers

    config = transformers.T5Config(
        vocab_size=40, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    return _params(transformers.T5ForConditionalGeneration(config))


def run_port(assets: Path, out: Path) -> None:
    """examples/trl_sft.py as a user runs it (TRL's parser; it ends with trainer.end())."""
    argv = ["--model_name_or_path", str(assets / "model"), "--dataset_name", str(assets / "text")]
    argv += ["--output_dir", str(out / "port"), "--max_length", "16", "--dtype", "float32"]
    for key, value in COMMON.items():
        argv += [f"--{key}", str(value)]
    saved = sys.argv
    sys.argv = ["trl_sft.py", *argv]
    try:
        runpy.run_path(str(ROOT / "examples/trl_sft.py"), run_name="__main__")
    finally:
        sys.argv = saved


CASES = {
    "sft": lambda a, o: run_sft(a, o, packing=False),
    "packed": lambda a, o: run_sft(a, o, packing=True),
    "dpo": run_dpo,
    "s2s": run_seq2seq,
}


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(sys.argv[3]), exit=True)  # a hang: stacks, exit 1
    assets, out = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    if sys.argv[4:] != ["port-only"]:
        for name, case in CASES.items():
            torch.save(case(assets, out / f"{name}{rank}"), out / f"{name}{rank}.pt")
    run_port(assets, out / f"port{rank}")
