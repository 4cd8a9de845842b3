"""A plain Hugging Face script under ``UnevenTrainer``: a padded BERT classifier on 2 gloo ranks.

Run by tests/integrations/test_transformers_exit.py through torchrun. Like a user's script it
never ends the process group itself. An exit hook registered first (so it runs last, after
evendp's) records, on each rank, whether the default process group still exists or is still
alive in memory, and which threads are alive: what finalization would otherwise tear down.
"""

from __future__ import annotations

import atexit
import gc
import json
import sys
import threading
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import transformers

from evendp.integrations.transformers import UnevenTrainer


def _record(out: Path, seen: dict[str, Any]) -> None:
    gc.collect()
    state = {
        "initialized": dist.is_initialized(),
        "group_alive": seen["group"]() is not None,
        "threads": [t.name for t in threading.enumerate() if t is not threading.main_thread()],
    }
    (out / f"exit{seen['rank']}.json").write_text(json.dumps(state))


class _Data(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(3, 10, (16,), generator=g).tolist()
        self.items = [
            (torch.randint(1, 60, (n,), generator=g), i % 2) for i, n in enumerate(lengths)
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids, label = self.items[i]
        return {"input_ids": ids, "labels": torch.tensor(label)}


def _pad(features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = f["input_ids"]
        mask[row, : len(f["input_ids"])] = 1
    labels = torch.stack([f["labels"] for f in features])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def main(out: Path) -> None:
    seen: dict[str, Any] = {}
    atexit.register(_record, out, seen)  # registered first, so it runs after evendp's hook
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=2, pad_token_id=0,
    )  # fmt: skip
    args = transformers.TrainingArguments(
        str(out / "trainer_output"), per_device_train_batch_size=2, max_steps=2, report_to="none",
        use_cpu=True, ddp_backend="gloo", save_strategy="no", logging_strategy="no",
        disable_tqdm=True,
    )  # fmt: skip
    model = transformers.BertForSequenceClassification(config)
    trainer = UnevenTrainer(
        model, args, train_dataset=_Data(), data_collator=_pad, batch_sizes=[1, 3]
    )
    trainer.train()
    group = dist.distributed_c10d._get_default_group()
    # The trainer stays alive until exit, as one at a script's top level does.
    seen.update(rank=dist.get_rank(), group=weakref.ref(group), trainer=trainer)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
