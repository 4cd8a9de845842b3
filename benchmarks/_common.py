"""What several benchmarks share: a clock of optimizer steps and a tiny token dataset.

Imported by the scripts run as ``python benchmarks/NAME.py`` (their folder is on ``sys.path``).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["StepClock", "Tokens", "hf_gpt2_run", "save_figures", "spawn_two_ranks", "start_rank"]


def save_figures(figures: Any, path: str | None) -> None:
    """Write a benchmark's figures as JSON to ``path`` (``--json``; ``None``: nowhere), the
    form ``gpu_checks.py`` reads back into the session's summary."""
    if path:
        Path(path).write_text(json.dumps(figures, indent=1))


def spawn_two_ranks(worker: Callable[..., None], args: Any) -> Any:
    """Run ``worker(rank, port, out, args)`` on two spawned ranks; what rank 0 wrote to
    ``out`` as JSON."""
    import torch.multiprocessing as mp

    from evendp._planning._launch import _free_port  # a free port, never torchrun's 29500

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        mp.start_processes(worker, args=(_free_port(), out, args), nprocs=2, start_method="spawn")
        return json.loads(Path(out).read_text())


SEQ, VOCAB = 16, 64  # the tiny GPT-2's rows


def hf_gpt2_run(tmp: str, steps: int, per_device: int) -> tuple[Any, Any]:
    """A tiny GPT-2 (dropout off, seeded) and HF ``TrainingArguments`` for ``steps`` steps of
    ``per_device`` rows on gloo CPU ranks, logging and saving nothing."""
    import transformers

    config = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    training = transformers.TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=per_device, max_steps=steps,
        learning_rate=1e-3, report_to="none", save_strategy="no", logging_strategy="no",
        disable_tqdm=True, use_cpu=True, ddp_backend="gloo", seed=0,
    )  # fmt: skip
    return model, training


def start_rank(rank: int, port: int, world: int = 2) -> None:
    """Make this spawned process rank ``rank`` of a gloo group on loopback, with what
    torchrun would have set (offline, one thread)."""
    import evendp

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        HF_HUB_OFFLINE="1",
    )  # fmt: skip
    torch.set_num_threads(1)
    evendp.init_distributed("gloo")


class StepClock:
    """Wall time at the end of every optimizer step: the evendp Trainer's ``scheduler=`` (it
    steps it once per optimizer step), or an HF callback (:meth:`hf_callback`)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def step(self) -> None:
        self.times.append(time.perf_counter())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def median_step(self, last: int) -> float:
        """The median seconds of one of the ``last`` steps."""
        return statistics.median(b - a for a, b in itertools.pairwise(self.times[-last - 1 :]))

    def hf_callback(self) -> Any:
        import transformers

        clock = self

        class _Clock(transformers.TrainerCallback):
            def on_step_end(self, *args: Any, **kwargs: Any) -> None:
                clock.step()

        return _Clock()


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``n`` rows of ``seq`` random token ids below ``vocab``, each its own label (seeded)."""

    def __init__(self, n: int, seq: int, vocab: int) -> None:
        self.ids = torch.randint(1, vocab, (n, seq), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}
