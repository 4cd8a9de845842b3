"""What a steady training step costs on one GPU, and how often it waits for the device.

One process, GPT-2 124M from ``transformers`` (sequence 512, bf16 autocast, AdamW, clipping at
1.0, batch 16): ``evendp.Trainer`` against a plain PyTorch loop, and evendp's ``UnevenTrainer``
against the ``transformers.Trainer`` it extends. Each run's steady steps (after ``--warmup``)
are timed between two device synchronisations; during them CUDA itself counts the host syncs
(``torch.cuda.set_sync_debug_mode("warn")``: every synchronizing call warns once), reported
per step. Target: the step ratios near 1.0, UnevenTrainer's syncs per step equal to the HF
Trainer's.

    python benchmarks/step_costs.py [--steps 20] [--warmup 5] [--json F]
    python benchmarks/step_costs.py --smoke   # CPU: a tiny GPT-2, timings only
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _common import Tokens, save_figures
from torch import nn

SYNC_WARNING = "synchronizing CUDA operation"


class Window:
    """The steady steps: from the end of step ``warmup`` to the end of step ``warmup + steps``,
    timed between two synchronisations, the host syncs between them counted by CUDA."""

    def __init__(self, warmup: int, steps: int, device: torch.device) -> None:
        self.warmup, self.steps, self.device = warmup, steps, device
        self.seconds = 0.0
        self.syncs: int | None = None
        self._caught: Any = None
        self._start = 0.0

    def at_step_end(self, step: int) -> None:
        """Call after each optimizer step (``step`` 1-based)."""
        if step == self.warmup:
            self._sync()
            self._start = time.perf_counter()
            self._count(True)
        elif step == self.warmup + self.steps:
            self._count(False)
            self._sync()
            self.seconds = (time.perf_counter() - self._start) / self.steps

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _count(self, start: bool) -> None:
        if self.device.type != "cuda":
            return
        if start:
            self._caught = warnings.catch_warnings(record=True)
            self.log = self._caught.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            torch.cuda.set_sync_debug_mode("default")
            self._caught.__exit__(None, None, None)
            hits = [w for w in self.log if SYNC_WARNING in str(w.message)]
            self.syncs = len(hits)

    def figures(self) -> dict[str, Any]:
        per_step = None if self.syncs is None else self.syncs / self.steps
        return {"ms_per_step": round(self.seconds * 1e3, 3), "syncs_per_step": per_step}


def _config(smoke: bool) -> tuple[Any, int, int]:
    from transformers import GPT2Config

    if smoke:
        return GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2), 32, 4
    return GPT2Config(), 512, 16  # 124M


def _model(config: Any, device: torch.device) -> nn.Module:
    from transformers import GPT2LMHeadModel

    torch.manual_seed(0)
    with torch.device(device):
        return GPT2LMHeadModel(config)


def plain_loop(config: Any, data: Tokens, batch: int, window: Window) -> None:
    device = window.device
    model = _model(config, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, drop_last=True,
                                         pin_memory=device.type == "cuda")  # fmt: skip
    step = 0
    while step < window.warmup + window.steps:
        for rows in loader:
            rows = {k: v.to(device, non_blocking=True) for k, v in rows.items()}
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(**rows).loss
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            window.at_step_end(step)
            if step == window.warmup + window.steps:
                break


def evendp_trainer(config: Any, data: Tokens, batch: int, window: Window) -> None:
    from evendp import TrainConfig, Trainer

    class AtStepEnd:
        def on_step_end(self, trainer: Any, step: int) -> None:
            window.at_step_end(step)

    cfg = TrainConfig(
        steps=window.warmup + window.steps, batch_size=batch, amp="bf16", lr=1e-4,
        grad_clip=1.0, progress=False, log_every=10**6,
    )  # fmt: skip
    model = _model(config, window.device)
    Trainer(model, data, cfg, device_ids=[window.device], callbacks=[AtStepEnd()]).fit()


def _hf_trainer(cls: type, config: Any, data: Tokens, batch: int, window: Window) -> None:
    import transformers

    class AtStepEnd(transformers.TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            window.at_step_end(state.global_step)

    with tempfile.TemporaryDirectory() as tmp:
        args = transformers.TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=batch,
            max_steps=window.warmup + window.steps, learning_rate=1e-4, max_grad_norm=1.0,
            bf16=window.device.type == "cuda", use_cpu=window.device.type != "cuda",
            report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
            seed=0,
        )  # fmt: skip
        model = _model(config, window.device)
        trainer = cls(model=model, args=args, train_dataset=data, callbacks=[AtStepEnd()])
        trainer.train()


def hf_trainer(config: Any, data: Tokens, batch: int, window: Window) -> None:
    import transformers

    _hf_trainer(transformers.Trainer, config, data, batch, window)


def uneven_trainer(config: Any, data: Tokens, batch: int, window: Window) -> None:
    from evendp.integrations.transformers import UnevenTrainer

    _hf_trainer(UnevenTrainer, config, data, batch, window)


RUNS: dict[str, Callable[[Any, Tokens, int, Window], None]] = {
    "plain": plain_loop,
    "trainer": evendp_trainer,
    "hf": hf_trainer,
    "uneven": uneven_trainer,
}


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def measure(smoke: bool, warmup: int, steps: int) -> dict[str, Any]:
    device = torch.device("cpu" if smoke else "cuda", 0 if not smoke else None)
    config, seq, batch = _config(smoke)
    data = Tokens(batch * (warmup + steps + 2), seq, config.vocab_size)
    rows: dict[str, Any] = {}
    for name, run in RUNS.items():
        window = Window(warmup, steps, device)
        with _quiet() if smoke else contextlib.nullcontext():
            run(config, data, batch, window)
        rows[name] = window.figures()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        print(name, rows[name], flush=True)

    def ratio(a: str, b: str) -> float | None:
        return rows[a]["ms_per_step"] / rows[b]["ms_per_step"] if rows[b]["ms_per_step"] else None

    return {
        "runs": rows, "trainer_vs_plain": ratio("trainer", "plain"),
        "uneven_vs_hf": ratio("uneven", "hf"),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--smoke", action="store_true", help="CPU: a tiny GPT-2, 2 steps")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("step_costs.py needs a CUDA device (or --smoke)")
    warmup, steps = (1, 2) if args.smoke else (args.warmup, args.steps)
    figures = measure(args.smoke, warmup, steps)
    print(json.dumps(figures))
    save_figures(figures, args.json)


if __name__ == "__main__":
    main()
