"""Every ``Trainer(strategy="deepspeed")`` case in one launch (2 gloo ranks), read by
test_strategy_deepspeed.py, which runs the one-process references.

Usage: evendp launch --nproc 2 tests/training/_deepspeed_strategy_script.py OUT HANG_S [DISK]
(DISK: a small file system the test mounted, for the full-disk case)
DeepSpeed's start-up is the cost: one process group for every case. Each case writes each
rank's final parameters (ZeRO-3: gathered whole) to ``OUT/<case>/rank<R>.pt``.
"""

from __future__ import annotations

import faulthandler
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import evendp

#: 17 samples, 4 per step: the fifth step is the short one (1 sample, one rank empty).
SAMPLES = 17

#: case -> settings; read by the test for its references too.
CASES: dict[str, dict[str, Any]] = {
    # ZeRO-1, ranks of 1 and 3, SGD, clipping that bites, the short last step.
    "z1": {"model": "mlp", "sizes": [1, 3], "accum": 1, "stage": 1, "steps": 5, "opt": "sgd"},
    # ZeRO-2, rank 0 always empty, two micro-steps, the default AdamW.
    "z2_empty": {"model": "mlp", "sizes": [0, 4], "accum": 2, "stage": 2, "steps": 5, "opt": None},
    # ZeRO-3, a tiny GPT-2 with padding and -100 labels, counted tokens, two micro-steps.
    "z3_gpt2": {"model": "gpt2", "sizes": [1, 3], "accum": 2, "stage": 3, "steps": 5, "opt": "sgd"},
    # ZeRO-2, TrainConfig(warmup_steps=3): the schedule built on the engine's own optimizer.
    "z2_warmup": {
        "model": "mlp",
        "sizes": [1, 3],
        "accum": 1,
        "stage": 2,
        "steps": 4,
        "opt": None,
        "warmup": 3,
    },
    # ZeRO-3 with momentum (optimizer state): straight, and saved at 2 then resumed to 4.
    "z3_straight": {
        "model": "mlp",
        "sizes": [1, 3],
        "accum": 1,
        "stage": 3,
        "steps": 4,
        "opt": "momentum",
    },
}
RESUMED = "z3_resumed"  # CASES["z3_straight"], saved at step 2, resumed in a new Trainer
#: The resumed run again, its latest step's DeepSpeed file garbled: it falls back to step 2.
FELL_BACK = "z3_fell_back"


def mlp_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=g)
    return torch.utils.data.TensorDataset(x, (x @ torch.randn(8, 3, generator=g)).argmax(dim=1))


def mlp() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(self.net(x), y)

    return Classifier()


class Paragraphs(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Token rows of several lengths (one a single token: nothing to count after the shift)."""

    lengths = (1, 5, 9, 12, 3, 7, 12, 4, 6, 10, 2, 8, 11, 5, 9, 3, 12)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": (torch.arange(self.lengths[i]) * (i + 3)) % 60 + 1}

    @staticmethod
    def collate(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        width = max((len(r["input_ids"]) for r in rows), default=1)
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        labels = torch.full((len(rows), width), -100)
        for i, r in enumerate(rows):
            n = len(r["input_ids"])
            ids[i, :n], labels[i, :n] = r["input_ids"], r["input_ids"]
        return {"input_ids": ids, "labels": labels}


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def trainer(case: dict[str, Any], *, strategy: str | None, **extra: Any) -> evendp.Trainer:
    """The case's Trainer: under DeepSpeed on this launch's ranks (``strategy``), or the
    one-process reference (``None``: the whole step of 4 samples on one CPU device)."""
    model = gpt2() if case["model"] == "gpt2" else mlp()
    opt = case["opt"]
    optimizer = (
        None
        if opt is None
        else torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9 if opt == "momentum" else 0)
    )
    settings: dict[str, Any] = {
        "steps": case["steps"], "batch_size": 4, "accum": case["accum"], "lr": 0.01,
        "grad_clip": 1.0, "progress": False, "max_nonfinite_steps": 0,
        "warmup_steps": case.get("warmup", 0),
    }  # fmt: skip
    if strategy is not None:
        settings.update(
            batch_sizes=case["sizes"],
            strategy=strategy,
            strategy_config={"zero_optimization": {"stage": case["stage"]}},
        )
    settings.update(extra)
    gpt = case["model"] == "gpt2"
    return evendp.Trainer(
        model,
        Paragraphs() if gpt else mlp_data(),
        evendp.TrainConfig(**settings),
        device_ids=None if strategy is not None else ["cpu"],
        optimizer=optimizer,
        count_fn=evendp.count_tokens(shift=True) if gpt else None,
        collate_fn=Paragraphs.collate if gpt else None,
    )


def parameters(t: evendp.Trainer) -> dict[str, torch.Tensor]:
    """The whole parameters (ZeRO-3 gathers them on every rank: a collective)."""
    import deepspeed

    with deepspeed.zero.GatheredParameters(list(t.model.parameters())):
        return {k: v.detach().clone() for k, v in t.model.named_parameters()}


def run(name: str, out: Path, case: dict[str, Any], **extra: Any) -> evendp.Trainer:
    t = trainer(case, strategy="deepspeed", **extra)
    t.fit()
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(parameters(t), folder / f"rank{dist.get_rank()}.pt")
    return t


#: The host-read cases: name -> TrainConfig settings (ZeRO-2, the default AdamW).
HOST_READS = {"deepspeed": {}, "deepspeed, no clipping": {"grad_clip": None}}


def host_reads(out: Path) -> None:
    """The host-read count of test_host_reads.py on this launch's ranks: steady DeepSpeed
    steps, windows between log steps."""
    from tests.training import test_host_reads as reads

    for name, settings in HOST_READS.items():
        config = reads._config(
            batch_sizes=reads.SIZES, strategy="deepspeed",
            strategy_config={"zero_optimization": {"stage": 2}}, **settings,
        )  # fmt: skip
        trainer = evendp.Trainer(reads._gpt(), reads._samples(), config, loss_fn=reads._gpt_loss)
        summary = reads._summary(reads._fit_counting(trainer))
        (out / "host_reads" / name).mkdir(parents=True, exist_ok=True)
        torch.save(summary, out / "host_reads" / name / f"rank{dist.get_rank()}.pt")


def group_timeouts() -> list[float]:
    """Every process group's collective timeout (s) on this rank: DeepSpeed's own included."""
    from torch.distributed.distributed_c10d import _world

    cpu = torch.device("cpu")
    return [pg._get_backend(cpu).options._timeout.total_seconds() for pg in _world.pg_map]


def main(out: Path) -> None:
    host_reads(out)
    for name, case in CASES.items():
        run(name, out, case)
    if dist.get_rank() == 0:
        (out / "timeouts.txt").write_text(repr(group_timeouts()))
    case, ckpt = CASES["z3_straight"], out / "resume_run"
    run(f"{RESUMED}_first", out, {**case, "steps": 2}, out_dir=str(ckpt))
    t = run(RESUMED, out, case, out_dir=str(ckpt), resume=True)
    if dist.get_rank() == 0:  # what the resumed run started from, for the test to read
        (out / RESUMED / "notes.txt").write_text("\n".join(t.state.notes))
        modes = {str(p.relative_to(ckpt)): p.stat().st_mode & 0o777 for p in ckpt.rglob("*")}
        (out / RESUMED / "modes.txt").write_text(repr(modes))
    fall_back(out, case, ckpt)
    if len(sys.argv) > 3:  # the test mounted a small file system there
        full_disk(out, Path(sys.argv[3]))


def full_disk(out: Path, disk: Path) -> None:
    """Saved at step 1 on a small file system, which is then filled: the save at step 2 fails
    on every rank alike (one error, after DeepSpeed's collectives), step 1 stays resumable."""
    case, where = {**CASES["z3_straight"], "steps": 1}, disk / "run"
    run("disk_first", out, case, out_dir=str(where))
    if dist.get_rank() == 0:
        from tests._helpers import fill_disk

        fill_disk(disk / "filler")
    dist.barrier()
    try:
        run("disk_second", out, {**case, "steps": 2}, out_dir=str(where), resume=True,
            comm_timeout=60)  # fmt: skip
        said: tuple[str, str] = ("ok", "")
    except evendp.EvendpError as exc:
        said = (type(exc).__name__, str(exc))
    (out / "full_disk").mkdir(exist_ok=True)
    (out / "full_disk" / f"rank{dist.get_rank()}.txt").write_text(repr(said))
    dist.barrier()
    if dist.get_rank() == 0:
        (disk / "filler").unlink()
        kept = sorted(str(p.relative_to(where)) for p in (where / "ckpt.ds").rglob("*"))
        (out / "full_disk" / "kept.txt").write_text(repr(kept))


def fall_back(out: Path, case: dict[str, Any], ckpt: Path) -> None:
    """A copy of the resumed run's folder whose step-4 partition file is garbled: a resume
    falls back to the previous position (step 2) and trains on to step 4."""
    import shutil

    copy = out / "fall_back_run"
    if dist.get_rank() == 0:
        shutil.copytree(ckpt, copy)
        for garbled in (copy / "ckpt.ds" / "step4").glob("*model_states.pt"):
            garbled.write_bytes(b"not a checkpoint")
    dist.barrier()
    t = run(FELL_BACK, out, case, out_dir=str(copy), resume=True)
    if dist.get_rank() == 0:
        (out / FELL_BACK / "notes.txt").write_text("\n".join(t.state.notes))
        kept = sorted(p.name for p in (copy / "ckpt.ds").glob("step*"))
        (out / FELL_BACK / "kept.txt").write_text(" ".join(kept))


if __name__ == "__main__":
    faulthandler.dump_traceback_later(float(sys.argv[2]), exit=True)  # a hang: stacks, exit 1
    evendp.init_distributed("gloo")
    main(Path(sys.argv[1]))
    (Path(sys.argv[1]) / f"done{os.environ['RANK']}").write_text("ok")
