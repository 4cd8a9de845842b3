"""Every DeepSpeed check in one launch (2 gloo ranks, ``--batch-sizes 1,3``), read by
test_deepspeed.py.

Usage: evendp launch --nproc 2 --batch-sizes 1,3 tests/integrations/_deepspeed_script.py OUT HANG_S
One gloo group for all of them (DeepSpeed and the frameworks find it started): the three ports
of examples/ (HF Trainer + deepspeed=, Accelerate + DeepSpeedPlugin, the engine loop with
EngineMean) on ZeRO stages 1 to 3, a Trainer checkpoint written by DeepSpeed resumed, and
degenerate batches. 17 samples: the short last micro-step is [0, 1], rank 0 empty.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

import evendp

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

#: name -> (example, arguments); the outputs land in OUT/<name>/
SHORT = ["--samples", "17", "--epochs", "2"]
RUNS: dict[str, tuple[str, list[str]]] = {
    "trainer_z2": ("deepspeed_trainer", ["--samples", "17", "--zero-stage", "2"]),
    "trainer_z3": (
        "deepspeed_trainer",
        ["--samples", "17", "--zero-stage", "3", "--save-steps", "2"],
    ),
    **{f"loop_z{z}": ("deepspeed_loop", [*SHORT, "--zero-stage", str(z)]) for z in (1, 2, 3)},
    **{
        f"accelerate_z{z}": ("deepspeed_accelerate", [*SHORT, "--zero-stage", str(z)])
        for z in (2, 3)
    },
}

#: degenerate token sequences: lengths (0 = a row of padding only, beside longer rows); in
#: sequential order rank 0 (size 1) first takes the 1-token sequence (no label after the causal
#: shift: its first batch counts nothing), and the short last micro-step leaves rank 1 empty
DEGENERATE = [1, 5, 0, 12, 3, 9, 12, 7, 4]


def run(name: str, out: Path, extra: list[str] | None = None) -> None:
    example, args = RUNS[name]
    main = runpy.run_path(str(EXAMPLES / f"{example}.py"), run_name="port")["main"]
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    if example == "deepspeed_trainer":  # every rank the same checkpoint folder
        args = [*args, "--output-dir", str(out / f"{name}_ckpt")]
    main([*args, *(extra or []), "--out", str(folder)])


def _reset_accelerate() -> None:
    """A fresh AcceleratorState: the next run brings its own DeepSpeed plugin."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def degenerate(out: Path, deepspeed: dict[str, Any] | None, batch_sizes: list[int]) -> None:
    """UnevenTrainer (ZeRO-2 when ``deepspeed``) on :data:`DEGENERATE`, parameters to ``out``."""
    from transformers import TrainingArguments

    from evendp.integrations.transformers import UnevenTrainer

    port = runpy.run_path(str(EXAMPLES / "deepspeed_trainer.py"), run_name="port")
    data = [{"input_ids": torch.arange(n) % 60 + 1} for n in DEGENERATE]
    args = TrainingArguments(
        output_dir=str(out / "trainer_output"),  # inside the test's folder: nothing left behind
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        num_train_epochs=2,
        optim="sgd",
        learning_rate=0.5,
        train_sampling_strategy="sequential",
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        deepspeed=deepspeed,
    )
    model = port["make_model"]()  # undeclared: the loss-kwargs probe is agreed across ranks
    trainer = UnevenTrainer(
        model, args, train_dataset=data, data_collator=port["pad"], batch_sizes=batch_sizes
    )
    trainer.train()
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)
    torch.save(state, out / f"degenerate{args.process_index}.pt")


#: The "auto" schedule case: samples (6 steps of 4), warm-up steps, peak learning rate.
SCHEDULE = {"samples": 24, "warmup": 2, "lr": 0.1}


def schedule(out: Path) -> None:
    """UnevenAccelerator with a DeepSpeed config whose scheduler is all "auto"
    (WarmupDecayLR), filled from a DummyScheduler of the run's steps: each step's learning
    rate and the schedule's length, for the test to compare with one process (issue 36: the
    length was halved on 2 ranks and the rate reached 0 half-way)."""
    import json

    import torch.nn.functional as F
    from accelerate import PartialState
    from accelerate.utils import DeepSpeedPlugin, DummyScheduler

    from evendp.integrations.accelerate import UnevenAccelerator, uneven_dataloader

    auto = ("total_num_steps", "warmup_num_steps", "warmup_min_lr", "warmup_max_lr")
    config = {
        "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
        "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "scheduler": {"type": "WarmupDecayLR", "params": dict.fromkeys(auto, "auto")},
    }  # fmt: skip
    PartialState(cpu=True)
    accelerator = UnevenAccelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=config))
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(SCHEDULE["samples"], 4, generator=g))
    loader = uneven_dataloader(accelerator, data, shuffle=False)  # EVENDP_BATCH_SIZES
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=SCHEDULE["lr"])
    steps = len(loader)  # per rank already: the run's optimizer steps
    dummy = DummyScheduler(optimizer, total_num_steps=steps, warmup_num_steps=SCHEDULE["warmup"])
    model, optimizer, loader, dummy = accelerator.prepare(model, optimizer, loader, dummy)
    rates = []
    for (x,) in loader:
        accelerator.backward(F.mse_loss(model(x), x.sum(dim=1, keepdim=True)))
        optimizer.step()
        dummy.step()
        optimizer.zero_grad()
        rates.append(model.get_lr()[0])
    said = {"steps": steps, "total": model.lr_scheduler.total_num_steps, "rates": rates}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(said))


ZERO2 = {
    "train_micro_batch_size_per_gpu": "auto",
    "train_batch_size": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 2},
    "zero_allow_untested_optimizer": True,
}


def main(out: Path) -> None:
    for name in ("trainer_z2", "trainer_z3"):
        run(name, out)
        _reset_accelerate()
    # Resume the ZeRO-3 run from the checkpoint DeepSpeed wrote after step 4 of 6.
    checkpoint = out / "trainer_z3_ckpt" / "checkpoint-4"
    (out / "resumed").mkdir(exist_ok=True)
    main_ = runpy.run_path(str(EXAMPLES / "deepspeed_trainer.py"), run_name="port")["main"]
    main_(["--samples", "17", "--zero-stage", "3", "--resume", str(checkpoint), "--out",
           str(out / "resumed"), "--output-dir", str(out / "resumed_ckpt")])  # fmt: skip
    _reset_accelerate()
    (out / "degenerate").mkdir(exist_ok=True)
    degenerate(out / "degenerate", ZERO2, [1, 3])
    _reset_accelerate()
    for name in ("loop_z1", "loop_z2", "loop_z3"):
        run(name, out)
    # An empty share in every step: rank 0 only ever runs stand-ins.
    with mock.patch.dict(os.environ, {"EVENDP_BATCH_SIZES": "0,4"}):
        RUNS["loop_empty"] = ("deepspeed_loop", RUNS["loop_z2"][1])
        run("loop_empty", out)
    (out / "schedule").mkdir(exist_ok=True)
    schedule(out / "schedule")
    _reset_accelerate()
    # Accelerate's end_training destroys the group: only the last run may.
    from evendp.integrations.accelerate import UnevenAccelerator

    with mock.patch.object(UnevenAccelerator, "end_training", lambda self: None):
        run("accelerate_z2", out)
    _reset_accelerate()
    run("accelerate_z3", out)


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)  # a hang: stacks, exit 1
    evendp.init_distributed("gloo")
    main(Path(sys.argv[1]))
    (Path(sys.argv[1]) / f"done{os.environ['RANK']}").write_text("ok")
