"""Issue 26, item 5: a steady-state training step reads no tensor value on the host.

On a GPU every such read (``float(norm)``, ``flag.item()``, ``votes.tolist()``) waits for the
device, so the CPU cannot queue the next step ahead; nanoGPT and torchtitan read only at log
steps. tests/_host_reads.py counts the reads on the step's thread; each ``Trainer.fit`` here
runs STEPS steps of a tiny causal LM (evendp's nanoGPT-style demo GPT; one case a transformers
GPT-2) on right-padded windows with ``-100`` labels, with ``log_every`` past the end,
no evaluation, no checkpoint, no callbacks, the default optimizer (AdamW) and
``max_nonfinite_steps`` (3). Reads are grouped by the Trainer's step when they happen: the
window ``k`` runs from the end of step ``k`` (its log, stop vote) to the end of step ``k + 1``'s
optimizer step. Window 0 (start-up, the first step's one-off checks), window 1 (step 1 is a
display step with ``progress=True``) and the last (the final read and report) are left out;
windows 2..STEPS-1 must read nothing, for every strategy:

- balanced DP in one process (``device_ids=["cpu"] * 2``), with and without a progress bar,
  with a learning-rate scheduler, with ``count_fn``;
- on 2 gloo ranks (spawned once for the module): DDP with ``oom_resplit=False``, FSDP2,
  DeepSpeed (skipped while ``TrainConfig`` refuses ``strategy="deepspeed"``), and the OOM-safe
  DDP (the default), which may keep ONE read per step: the ranks' OOM flag, read by
  ``OomSafeDDP.agree_step``, decides which collectives run next (re-split or go on), and a
  decision that changes the collectives must be agreed on the host.

The reads of the optimizer's step counts (torch keeps them on the CPU, a plain loop reads
them too) are not counted: :func:`tests._host_reads.optimizer_steps`. A failure prints every
read of the failing window with the evendp function that made it.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from evendp import EvendpError, TrainConfig, Trainer
from evendp._distributed._group import finish_distributed
from evendp.examples.gpt import GPT, GPTConfig
from tests._helpers import run_ranks
from tests._host_reads import HostRead, HostReads, culprits, optimizer_steps
from tests.training.test_eval import IGNORE, lm_count, lm_loss, lm_samples, tiny_gpt2

STEPS = 5
LOG_EVERY = 100  # past STEPS: no log step but the first and the last
MEASURED = range(2, STEPS)  # the steady-state windows (module docstring)
WORLD = 2
SIZES = [2, 3]  # uneven per-rank batch sizes

#: Reads a case may keep per window: {case: (most reads, the evendp file:function, why)}.
ALLOWED: dict[str, tuple[int, str, str]] = {
    "oom-safe ddp": (
        1,
        "evendp/_training/_strategies/_ddp.py:agree_step",
        "the ranks' OOM flag decides which collectives run next",
    ),
    "oom-safe ddp, progress": (
        1,
        "evendp/_training/_strategies/_ddp.py:agree_step",
        "the ranks' OOM flag decides which collectives run next",
    ),
    "oom-safe ddp, count_fn": (
        1,
        "evendp/_training/_strategies/_ddp.py:agree_step",
        "the ranks' OOM flag decides which collectives run next",
    ),
    "balanced dp, scheduler": (
        1,
        "evendp/_training/_step.py:_schedule_late",
        "the schedule holds on a skipped step: the previous step's flag, read a step late",
    ),
    # Measured in test_strategy_deepspeed.py's launch: the reads are DeepSpeed 0.19.8's own,
    # inside engine.step (deepspeed/runtime/utils.py is_invalid_grad_norm: its overflow check
    # of the norm, twice with clipping); evendp's code around the engine adds none.
    "deepspeed": (
        2,
        "evendp/_training/_strategies/_deepspeed.py:optimizer_step",
        "DeepSpeed's engine.step checks its gradient norm on the host",
    ),
    "deepspeed, no clipping": (
        1,
        "evendp/_training/_strategies/_deepspeed.py:optimizer_step",
        "DeepSpeed's engine.step checks its gradient norm on the host",
    ),
}

Windows = dict[int, list[HostRead]]


def _gpt(seed: int = 0) -> torch.nn.Module:
    """The demo GPT, tiny: the spawned ranks need not import transformers (4 s of CPU each)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16))


def _samples() -> Any:
    """64 right-padded windows: 12 steps of 5 fit in one epoch (no epoch turn measured)."""
    return lm_samples(64, seed=1)


def _gpt_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    ids, labels = batch
    return model(ids, labels)[1]  # the mean over labels that are not -100 (no shift)


def _gpt_count(batch: Any) -> torch.Tensor:
    return (batch[1] != IGNORE).sum()


def _fit_counting(trainer: Trainer) -> Windows:
    """Run ``trainer.fit()`` counting reads; the steady-state windows' reads."""
    ignore = optimizer_steps(lambda: trainer.optimizer)
    with HostReads(key=lambda: trainer.step, ignore=ignore) as reads:
        trainer.fit()
    assert trainer.step == STEPS
    return {k: reads.where(k) for k in MEASURED}


def _config(**kw: Any) -> TrainConfig:
    settings: dict[str, Any] = dict(
        steps=STEPS, log_every=LOG_EVERY, eval_every=0, checkpoint_every=0, progress=False
    )
    settings.update(kw)
    return TrainConfig(**settings)


def _check(case: str, windows: Windows, rank: int | None = None) -> None:
    """At most the case's allowed reads (none by default) in every steady-state window."""
    most, where, why = ALLOWED.get(case, (0, "", ""))
    for k, reads in windows.items():
        extra = [r for r in reads if not where or not r.culprit or where not in r.culprit]
        kept = len(reads) - len(extra)
        if extra or kept > most:
            pytest.fail(
                f"{case}{'' if rank is None else f' (rank {rank})'}: {len(reads)} host read(s) "
                f"between the ends of steps {k} and {k + 1} (not a log step), allowed {most}"
                f"{f' at {where} ({why})' if most else ''}; by "
                f"{sorted(set(culprits(reads)))}:\n{HostReads().describe(reads)}"
            )


# -- one process: balanced DP over two virtual CPU devices ---------------------------------


def _one_process(**kw: Any) -> Trainer:
    count_fn = kw.pop("count_fn", None)
    scheduled = kw.pop("scheduler", False)
    gpt2 = kw.pop("gpt2", False)
    model, loss_fn = (tiny_gpt2(), lm_loss) if gpt2 else (_gpt(), _gpt_loss)
    optimizer = scheduler = None
    if scheduled:  # the default optimizer's settings, built here to hang a schedule on it
        cfg = _config(batch_size=5, **kw)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 4))
    return Trainer(
        model, _samples(), _config(batch_size=5, **kw), device_ids=["cpu"] * 2,
        loss_fn=loss_fn, count_fn=count_fn, optimizer=optimizer, scheduler=scheduler,
    )  # fmt: skip


ONE_PROCESS: dict[str, dict[str, Any]] = {
    "balanced dp": {},
    "balanced dp, progress": {"progress": True},
    "balanced dp, scheduler": {"scheduler": True},
    "balanced dp, count_fn": {"count_fn": _gpt_count},
    "balanced dp, transformers gpt-2": {"gpt2": True, "count_fn": lm_count},
}


@pytest.mark.filterwarnings("ignore:Trainer\\(count_fn=None\\)")
@pytest.mark.parametrize("case", list(ONE_PROCESS))
def test_one_process(case: str) -> None:
    _check(case, _fit_counting(_one_process(**ONE_PROCESS[case])))


# -- two gloo ranks, spawned once ----------------------------------------------------------

TWO_RANKS: dict[str, dict[str, Any]] = {
    "ddp": {"strategy": "ddp", "oom_resplit": False},
    "ddp, progress": {"strategy": "ddp", "oom_resplit": False, "progress": True},
    "oom-safe ddp": {"strategy": "ddp"},
    "oom-safe ddp, progress": {"strategy": "ddp", "progress": True},
    "oom-safe ddp, count_fn": {"strategy": "ddp", "count_fn": _gpt_count},
    "fsdp2": {"strategy": "fsdp2"},
    "fsdp2, progress": {"strategy": "fsdp2", "progress": True},
}
# DeepSpeed's case runs in test_strategy_deepspeed.py's one launch (its start-up is the cost).


def _summary(windows: Windows) -> dict[int, list[tuple[str, str, str | None]]]:
    return {k: [(r.kind, r.site, r.culprit) for r in reads] for k, reads in windows.items()}


def _rank_case(kw: dict[str, Any]) -> Any:
    """One case on this rank: its windows' reads, or why it cannot run yet."""
    kw = dict(kw)
    count_fn = kw.pop("count_fn", None)
    try:
        cfg = _config(batch_sizes=SIZES, **kw)
    except (EvendpError, ValueError) as error:  # a strategy TrainConfig does not accept yet
        return f"TrainConfig refuses {kw}: {error}"
    trainer = Trainer(_gpt(), _samples(), cfg, loss_fn=_gpt_loss, count_fn=count_fn)
    return _summary(_fit_counting(trainer))


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=120))
    results: dict[str, Any] = {}
    try:
        for case, kw in TWO_RANKS.items():
            results[case] = _rank_case(kw)
    finally:
        torch.save(results, Path(out) / f"rank{rank}.pt")
        finish_distributed()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("host_reads")
    return run_ranks(_worker, WORLD, out, timeout_s=240, what="the host-read runs")


def _windows(summary: Any) -> Windows:
    return {k: [HostRead(*r) for r in reads] for k, reads in summary.items()}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(TWO_RANKS))
def test_two_ranks(case: str, two_ranks: list[dict[str, Any]]) -> None:
    results = [r[case] for r in two_ranks]
    if isinstance(results[0], str):
        pytest.skip(results[0])
    for rank, summary in enumerate(results):
        _check(case, _windows(summary), rank=rank)


def test_check_fails_on_a_read() -> None:
    """The check itself: a read in a steady-state window fails it, naming the culprit."""
    read = HostRead("__float__", "evendp/x.py:f:1", "evendp/x.py:f:1", 2)
    with pytest.raises(pytest.fail.Exception, match=r"1 host read.*evendp/x\.py:f"):
        _check("balanced dp", {2: [read]})
    allowed = ALLOWED["oom-safe ddp"][1]
    flag = HostRead("item", f"{allowed}:9", f"{allowed}:9", 2)
    _check("oom-safe ddp", {2: [flag]})
    with pytest.raises(pytest.fail.Exception, match="2 host read"):
        _check("oom-safe ddp", {2: [flag, flag]})
