"""DeepSpeed ZeRO with per-rank batch sizes: each port equals one process on the same batches.

One ``evendp launch`` (2 gloo ranks, ``--batch-sizes 1,3``, the real ``deepspeed`` on its CPU
accelerator) runs every check of tests/integrations/_deepspeed_script.py; the one-process
references run here: the DDP ports of the same scripts (examples/hf_trainer.py,
examples/accelerate_loop.py) with ``EVENDP_BATCH_SIZES=4``, and the engine loop on plain
torch. The changed-line counts docs/integrations.md quotes are measured in test_ports.py.
"""

from __future__ import annotations

import itertools
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests._helpers import require
from tests.integrations import _deepspeed_script as script
from tests.integrations import _ports_script as ports

require("deepspeed", "transformers")

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
#: A rank still running after this long is hung: it prints every thread's stack and exits 1.
HANG_S = 400


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deepspeed")
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("EVENDP_BATCH_SIZES", None)
    command = [sys.executable, "-m", "evendp", "launch", "--nproc", "2", "--batch-sizes", "1,3"]
    command += [str(ROOT / "tests/integrations/_deepspeed_script.py"), str(out), str(HANG_S)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=HANG_S + 120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def _one_process_port(port: str, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The DDP port ``port`` of examples/ in this process, sizes [4]: its final parameters."""
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "4")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    ports.run(port, out)
    name = {"hf_trainer": "hf", "accelerate_loop": "accelerate"}[port]
    return torch.load(out / f"{name}0.pt")


def _error(got: dict, want: dict, start: dict) -> float:
    """||got - want|| / ||want - start|| over the floating-point entries ``want`` has."""
    keys = [k for k in want if want[k].is_floating_point()]
    num = sum(float((got[k].float() - want[k]).norm() ** 2) for k in keys) ** 0.5
    den = sum(float((want[k] - start[k]).norm() ** 2) for k in keys) ** 0.5
    assert den > 0
    return num / den


def _ranks(run: str) -> tuple[int, ...]:
    """The ranks holding the whole parameters: under ZeRO-3 the frameworks' get_state_dict
    gathers them on rank 0 only (rank 1 saved None)."""
    return (0,) if run.endswith("z3") or run == "resumed" else (0, 1)


def _example(name: str) -> dict:
    return runpy.run_path(str(ROOT / f"examples/{name}.py"), run_name="x")


@pytest.mark.multiprocess
def test_trainer_with_deepspeed_zero2_zero3_and_a_resumed_checkpoint_equal_one_process(
    launched: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = _one_process_port("hf_trainer", tmp_path, monkeypatch)
    start = _example("hf_trainer")["make_model"]().state_dict()
    for run in ("trainer_z2", "trainer_z3", "resumed"):
        for rank in _ranks(run):
            got = torch.load(launched / run / f"ds_trainer{rank}.pt")
            assert _error(got, want, start) < TOL, (run, rank)


@pytest.mark.multiprocess
def test_accelerate_with_a_deepspeed_plugin_equals_one_process(
    launched: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    want = _one_process_port("accelerate_loop", tmp_path, monkeypatch)
    (tmp_path / "start").mkdir()
    monkeypatch.setattr(ports, "PORTS", {**ports.PORTS, "accelerate_loop": ["--epochs", "0"]})
    start = _one_process_port("accelerate_loop", tmp_path / "start", monkeypatch)
    for run in ("accelerate_z2", "accelerate_z3"):
        for rank in _ranks(run):
            got = torch.load(launched / run / f"ds_accelerate{rank}.pt")
            assert _error(got, want, start) < TOL, (run, rank)


def _engine_loop_reference(samples: int, epochs: int) -> tuple[dict, dict]:
    """examples/deepspeed_loop.py's training in one process, plain torch: the windows of
    2 micro-batches of 4 samples (the epoch's last window shorter), the mean loss over each
    window, clipping at 1.0 (as DeepSpeed's gradient_clipping), SGD."""
    loop = _example("deepspeed_loop")
    data, model = loop["make_data"](samples), loop["make_model"]()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    import evendp

    sampler = evendp.UnevenBatchSampler(data, [4], rank=0, world_size=1, seed=0)
    clipped = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        micro = list(sampler)
        for w in range(0, len(micro), 2):
            idx = list(itertools.chain(*micro[w : w + 2]))
            x, y = data.tensors[0][idx], data.tensors[1][idx]
            F.cross_entropy(model(x), y).backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            clipped += int(norm > 1.0)
            optimizer.step()
            optimizer.zero_grad()
    assert clipped > 0  # the clipping the check relies on happens
    return model.state_dict(), start


@pytest.mark.multiprocess
@pytest.mark.parametrize("run", ["loop_z1", "loop_z2", "loop_z3", "loop_empty"])
def test_engine_loop_with_engine_mean_equals_one_process(launched: Path, run: str) -> None:
    want, start = _engine_loop_reference(samples=17, epochs=2)
    for rank in (0, 1):
        got = torch.load(launched / run / f"ds_loop{rank}.pt")
        assert _error(got, want, start) < TOL, rank


@pytest.mark.multiprocess
def test_degenerate_batches_on_deepspeed_finish_and_equal_one_process(
    launched: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """1-token sequences, an all-padding row, an empty share in the short last step, and
    rank 0's first batch counting no token: every rank finishes, the parameters are exact."""
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "EVENDP_BATCH_SIZES"):
        monkeypatch.delenv(var, raising=False)
    script.degenerate(tmp_path, None, [4])
    want = torch.load(tmp_path / "degenerate0.pt")
    start = _example("deepspeed_trainer")["make_model"]().state_dict()
    assert (launched / "done0").exists() and (launched / "done1").exists()
    for rank in (0, 1):
        got = torch.load(launched / "degenerate" / f"degenerate{rank}.pt")
        assert _error(got, want, start) < TOL, rank


@pytest.mark.parametrize("port", ["deepspeed_trainer", "deepspeed_accelerate", "deepspeed_loop"])
def test_the_docs_quote_the_measured_changed_lines(port: str) -> None:
    from tests.integrations.test_ports import changed_lines

    added, removed = changed_lines(port)
    docs = (ROOT / "docs/integrations.md").read_text()
    quoted = re.search(rf"`examples/{port}\.py`[^\n]*?\+(\d+)/-(\d+)", docs)
    assert quoted is not None, f"docs/integrations.md quotes no +N/-M for examples/{port}.py"
    assert (int(quoted[1]), int(quoted[2])) == (added, removed)


@pytest.mark.multiprocess
def test_an_auto_deepspeed_schedule_under_accelerate_is_the_runs_length(launched: Path) -> None:
    """issue 36: Accelerate fills a DeepSpeed config's "auto" scheduler fields with
    total_num_steps / num_processes, for a loader it shards; the uneven loader is per rank, so
    on 2 ranks WarmupDecayLR ended half-way (weights 0.64 off). Every step's learning rate
    equals one process's WarmupDecayLR over the run's steps."""
    import json

    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    said = [json.loads((launched / "schedule" / f"rank{r}.json").read_text()) for r in (0, 1)]
    steps = said[0]["steps"]
    assert steps == script.SCHEDULE["samples"] // 4  # [1, 3]: 4 samples per step
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=script.SCHEDULE["lr"])
    one = WarmupDecayLR(
        optimizer, total_num_steps=steps, warmup_min_lr=0, warmup_max_lr=script.SCHEDULE["lr"],
        warmup_num_steps=script.SCHEDULE["warmup"],
    )  # fmt: skip
    want = []
    for _ in range(steps):
        optimizer.step()
        one.step()
        want.append(one.get_last_lr()[0])
    for rank in said:
        assert rank["total"] == steps  # was steps // 2
        assert rank["rates"] == pytest.approx(want, rel=1e-6, abs=1e-9)
