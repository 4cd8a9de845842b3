"""``evendp launch``: argument handling, and the end-to-end CPU run of examples/ddp_uneven.py."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import evendp._planning._devices as devices_mod
from evendp._distributed._batch_plan import BatchPlan
from evendp._distributed._sampler import UnevenBatchSampler
from evendp.cli import main
from tests.planning.test_devices import FakeNvml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "ddp_uneven.py"


@pytest.fixture(autouse=True)
def no_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices_mod, "load_nvml", lambda: FakeNvml(None))


def test_dry_run_prints_env_and_command(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["launch", "--batch-sizes", "3,5", "--dry-run", "train.py", "--lr", "0.1"])
    assert code == 0
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0] == "EVENDP_BATCH_SIZES=3,5"
    assert "-m torch.distributed.run --nproc-per-node 2" in lines[1]
    assert lines[1].endswith("train.py --lr 0.1")  # script options are the script's
    assert "2 rank(s) on this machine, CPU (gloo); batch sizes [3, 5]" in captured.err


def test_dry_run_passes_multi_node_options(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["launch", "--nproc", "2", "--batch", "8", "--nnodes", "2", "--node-rank", "1"]
    argv += ["--master-addr", "10.0.0.1", "--master-port", "29400", "--dry-run", "t.py"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "EVENDP_BATCH_SIZES=2,2,2,2" in out
    assert "--nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29400 t.py" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--batch", "9", "--batch-sizes", "3,5"], "--batch 9 (the global batch per step) contra"),
        (["--nproc", "x"], "positive int or 'auto'"),
        (["--batch-sizes", "3,-1"], "-1"),
        (["--gpus", "0,1"], "no NVIDIA driver"),
    ],
)
def test_bad_input_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *argv, "--dry-run", "t.py"]) == 2
    assert message in capsys.readouterr().err


def test_batch_and_batch_sizes_that_agree_are_one_plan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["launch", "--batch", "8", "--batch-sizes", "3,5", "--dry-run", "t.py"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "EVENDP_BATCH_SIZES=3,5"


def test_a_contradicting_batch_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--batch", "9", "--batch-sizes", "3,5", "--dry-run", "t.py"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "evendp launch: error: --batch 9 (the global batch per step) contradicts --batch-sizes "
        "3,5 (each rank's share, 8 in all); give --batch 8, or only one of them\n"
    )


LM = ["--model", "lm-head", "--vocab", "1000", "--seq-len", "32"]


def _env_lists(out: str) -> dict[str, list[int]]:
    """The plan the dry run printed, read back as a rank reads it (the one channel)."""
    assert "EVENDP_BATCH_CAPS" not in out  # the caps ride in EVENDP_BATCH_SIZES
    found = re.search(r"^EVENDP_BATCH_SIZES=(\S+)$", out, flags=re.M)
    assert found is not None
    plan = BatchPlan.parse(found.group(1))
    return {"EVENDP_BATCH_SIZES": list(plan.sizes), "EVENDP_BATCH_CAPS": list(plan.caps or [])}


def test_dry_run_planned_sizes_and_caps(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["launch", *LM, "--memory", "24GiB,24GiB,12GiB", "--dry-run", "train.py"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    got = _env_lists(captured.out)
    sizes, caps = got["EVENDP_BATCH_SIZES"], got["EVENDP_BATCH_CAPS"]
    assert len(sizes) == len(caps) == 3
    assert sizes[0] == sizes[1] > sizes[2] > 0  # the 12 GiB rank gets fewer samples
    assert sizes == caps  # no --batch: the largest batch, every rank full
    assert "--nproc-per-node 3" in captured.out
    assert "planned (ddp) on declared memory" in captured.err
    assert "predicted peak" in captured.err  # the planner's table, for the person launching

    # A global batch under the largest: the planner's split of it, the caps unchanged.
    batch = sum(caps) * 3 // 4
    argv = ["launch", *LM, "--memory", "24GiB,24GiB,12GiB", "--batch", str(batch)]
    assert main([*argv, "--dry-run", "train.py"]) == 0
    again = _env_lists(capsys.readouterr().out)
    assert sum(again["EVENDP_BATCH_SIZES"]) == batch
    assert again["EVENDP_BATCH_SIZES"][2] < again["EVENDP_BATCH_SIZES"][0]
    assert again["EVENDP_BATCH_CAPS"] == caps

    # One more than fits: a clear error, exit 2.
    argv = ["launch", *LM, "--memory", "24GiB,24GiB,12GiB", "--batch", str(sum(caps) + 1)]
    assert main([*argv, "--dry-run", "train.py"]) == 2
    assert f"the largest that fits is {sum(caps)}" in capsys.readouterr().err


def bad_factory() -> object:
    raise RuntimeError("broken on purpose")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nonsense", "--memory", "8GiB"], "package.module:factory"),
        (["--model", "tests.cli.test_launch:bad_factory", "--memory", "8GiB"], "broken on purpose"),
        (["--model", "no_such_pkg.mod:f", "--memory", "8GiB"], "cannot load"),
        ([*LM], "declare it with --memory"),
        ([*LM, "--memory", "8GiB", "--batch-sizes", "3"], "nothing to plan"),
        ([*LM, "--memory", "2x8GiB", "--nproc", "3"], "--memory declares 2 devices"),
        (["--model", "lm-head", "--memory", "1GiB"], "not even one sample"),
        ([*LM, "--memory", "24 furlongs"], "cannot read device entry"),
    ],
)
def test_bad_model_input_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["launch", *argv, "--dry-run", "t.py"]) == 2
    assert message in capsys.readouterr().err


def _load_example() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ddp_uneven_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _single_process_losses(samples: int, epochs: int, sizes: list[int]) -> list[float]:
    """The example's training on one process: each step on the union of the ranks' batches."""
    data = _load_example().make_data(samples, 0)
    samplers = [UnevenBatchSampler(data, sizes, rank=r, seed=0) for r in range(len(sizes))]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for epoch in range(epochs):
        for s in samplers:
            s.set_epoch(epoch)
        for batches in zip(*samplers, strict=True):
            idx = [i for b in batches for i in b]
            x, y = data.tensors[0][idx], data.tensors[1][idx]
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


@pytest.mark.multiprocess
def test_launch_ddp_uneven_reports_exact_global_losses() -> None:
    env = {k: v for k, v in os.environ.items() if k != "EVENDP_BATCH_SIZES"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "evendp", "launch", "--nproc", "2", "--batch-sizes", "3,5"]
    cmd += [str(EXAMPLE), "--samples", "60", "--epochs", "2"]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "rank 0/2: batch size 3 of 8 [3, 5]" in proc.stdout
    assert "rank 1/2: batch size 5 of 8 [3, 5]" in proc.stdout
    got = [float(v) for v in re.findall(r"global loss ([0-9.]+)", proc.stdout)]
    want = _single_process_losses(60, 2, [3, 5])
    assert len(got) == len(want) == 16  # ceil(60 / 8) steps per epoch
    for g, w in zip(got, want, strict=True):
        assert abs(g - w) <= 1e-5 * max(1.0, abs(w))  # printed with 6 decimals


def _docs_trainer_script() -> str:
    """The script docs/training.md shows under "Under a launcher" (its first Python block)."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("### Under a launcher", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.multiprocess
def test_the_docs_trainer_script_trains_the_launchers_sizes_as_one_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 51: ``Trainer(model, data, TrainConfig(strategy="ddp", ...)).fit()`` under
    ``evendp launch --batch-sizes 12,4`` trained each rank alone ("dp on 1 device"), rank 1
    died with ``RunDirBusy``. Now the Trainer starts the group and takes the launcher's sizes:
    one run of ``[12, 4]``, rank 0 writing, no warning, the weights one process's on the whole
    16 samples. A launch of its own: the only one running evendp's own Trainer in a script."""
    monkeypatch.delenv("EVENDP_BATCH_SIZES", raising=False)
    script = tmp_path / "train.py"
    script.write_text(_docs_trainer_script())
    launched, alone = tmp_path / "launched", tmp_path / "alone"
    launched.mkdir()
    alone.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "evendp", "launch", "--nproc", "2", "--batch-sizes", "12,4"]
    proc = subprocess.run(
        [*cmd, str(script)], env=env, cwd=launched, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    assert said == ["evendp launch: 2 rank(s) on this machine, CPU (gloo); batch sizes [12, 4]"]
    report = json.loads((launched / "runs/launched/report.json").read_text())
    assert report["mode"] == "ddp" and report["batch_sizes_per_step"] == [[12, 4]] * 3
    # The same script in one process (this one): "ddp" runs dp there, on the whole 16.
    monkeypatch.chdir(alone)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", module="evendp")
        runpy.run_path(str(script), run_name="__main__")
    got = torch.load(launched / "runs/launched/ckpt.pt", weights_only=True)["model"]
    want = torch.load(alone / "runs/launched/ckpt.pt", weights_only=True)["model"]
    assert got.keys() == want.keys()
    diff = torch.cat([(got[k] - want[k]).flatten() for k in want]).norm()
    assert diff <= 1e-5 * torch.cat([w.flatten() for w in want.values()]).norm()


@pytest.mark.multiprocess
def test_an_unported_script_that_ignores_the_sizes_gets_a_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EVENDP_BATCH_SIZES", raising=False)
    script = tmp_path / "unported.py"
    script.write_text("print('training with my own batch of 4')\n")  # never reads the sizes
    assert main(["launch", "--nproc", "2", "--batch-sizes", "1,3", str(script)]) == 0
    err = capsys.readouterr().err
    assert "batch sizes [1, 3]" in err  # what the launcher printed ...
    assert "warning: no rank read the batch sizes [1, 3] set in EVENDP_BATCH_SIZES" in err
    assert "evendp.batch_sizes_from_env()" in err  # ... and the fix


# A DDP loop that never reads EVENDP_BATCH_SIZES (with "read": only rank 0 reads them).
_UNPORTED = """
import sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
if sys.argv[1:] == ["read"] and dist.get_rank() == 0:
    import evendp
    evendp.batch_sizes_from_env()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    loss = model(torch.randn(4, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
print(f"rank {dist.get_rank()} trained 3 steps", flush=True)
dist.destroy_process_group()
"""


@pytest.mark.multiprocess
def test_an_unported_loop_under_strict_stops_at_its_first_step_on_every_rank(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 36: told at the first step (the launcher's own warning came after the whole
    run), and ``--strict`` ends the ranks there, exit 2. One launch of its own: it exits
    otherwise than any shared one, and only rank 0 reads the sizes, so the ranks must agree.
    (The warning without ``--strict`` is the same hook: the in-process test below.)"""
    monkeypatch.delenv("EVENDP_BATCH_SIZES", raising=False)
    script = tmp_path / "unported.py"
    script.write_text(_UNPORTED)
    argv = ["launch", "--nproc", "2", "--batch-sizes", "1,3", "--strict", str(script), "read"]
    assert main(argv) == 2
    out, err = capfd.readouterr()
    told = [line for line in err.splitlines() if "first optimizer step" in line]
    assert len(told) == 1 and told[0].startswith("evendp launch: error: the script took its ")
    assert "batch sizes [1, 3]" in told[0] and "evendp.UnevenBatchSampler(data, " in told[0]
    assert "no rank read" not in err and "Traceback" not in err  # said once, in one line
    assert "trained 3 steps" not in out  # no rank went past its first step


def test_the_first_step_names_uneven_trainer_under_an_hf_trainer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port is read from the frames that call the step: a real HF Trainer's, here."""
    transformers = pytest.importorskip("transformers")
    from evendp._distributed import _first_step, _launch_notes

    monkeypatch.setattr(_launch_notes, "_read_here", False)
    monkeypatch.setattr(_first_step, "_SAMPLED", set())  # this process's earlier tests' sizes
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "1,3")
    monkeypatch.setenv("EVENDP_OUTCOME", str(tmp_path / "outcome.json"))
    monkeypatch.setenv("RANK", "0")
    # What a rank's first import of torch.optim.optimizer does (the module, not torch.optim's
    # attribute: the package deletes that name).
    _first_step._register(importlib.import_module("torch.optim.optimizer"))
    config = transformers.GPT2Config(vocab_size=16, n_positions=4, n_embd=8, n_layer=1, n_head=2)
    data = [{"input_ids": torch.arange(4), "labels": torch.arange(4)}] * 2
    args = transformers.TrainingArguments(
        str(tmp_path), per_device_train_batch_size=2, max_steps=1, report_to="none",
        use_cpu=True, disable_tqdm=True, save_strategy="no",
    )  # fmt: skip
    transformers.Trainer(transformers.GPT2LMHeadModel(config), args, train_dataset=data).train()
    told = [line for line in capsys.readouterr().err.splitlines() if "first optimizer" in line]
    assert len(told) == 1 and "it trains with an HF Trainer: port it, train with " in told[0]
    assert "evendp.integrations.transformers.UnevenTrainer in its place" in told[0]
    assert told[0].startswith("evendp launch: warning: ") and "--strict" in told[0]
    # Marked as told: the launcher does not warn a second time when the run ends.
    assert _launch_notes.sizes_were_told(tmp_path / "outcome.json")


@pytest.mark.parametrize(
    ("modules", "what"),
    [
        (["evendp._training._step", "evendp._training._trainer"], "evendp's Trainer"),
        (["transformers.trainer", "evendp.integrations.transformers"], "evendp's UnevenTrainer"),
        (["transformers.trainer", "accelerate.optimizer"], "an HF Trainer"),
        (["lightning.pytorch.loops.optimization"], "a Lightning Trainer"),
        (["accelerate.optimizer"], "an Accelerate loop"),
    ],
)
def test_the_first_step_never_sends_a_framework_user_to_the_sampler(
    modules: list[str], what: str
) -> None:
    """Issue 51: evendp's own Trainer (its frames are evendp's, and the launcher's wrapper is
    on every rank's stack) was told to port to ``UnevenBatchSampler`` and ``ddp_loss``."""
    from evendp._distributed._first_step import port_for

    wrapper = [
        "torch.optim.adamw",
        *modules,
        "__main__",
        "runpy",
        "evendp._distributed._first_step",
    ]
    said, fix = port_for(wrapper)
    assert said == what and "UnevenBatchSampler" not in fix and "ddp_loss" not in fix


def test_the_old_devices_flag_is_refused_naming_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "--devices", "0,1", "--dry-run", "t.py"]) == 2
    assert capsys.readouterr().err == (
        "evendp launch: error: unknown option --devices (did you mean --gpus?); "
        "see 'evendp launch --help'\n"
    )


# A launched script that plans on live GPUs (calibration: real optimizer steps, faked on
# the CPU by tests/planning/test_calibrate.py's measurer) before it reads the sizes.
_PLANS_FIRST = """
import torch, evendp
from evendp._planning import _on_device
from evendp.examples.lm_head import lm_loss
from tests.planning.test_calibrate import _Stepping, _lm
_on_device.live_cuda = lambda names: list(range(len(names)))  # as on a GPU machine
_on_device.measurer = lambda index, step: _Stepping(1 << 20, 1)
net, batch = _lm()
evendp.plan(net, batch, "64MiB", mode="ddp", criterion=lm_loss, cuda_context=0)
evendp.batch_sizes_from_env()
opt = torch.optim.SGD(net.parameters(), lr=0.1)
lm_loss(net(batch[0]), batch[1]).backward()
opt.step()
print("trained", flush=True)
"""


def test_a_plan_calibrating_before_the_sizes_are_read_is_not_the_first_step(
    tmp_path: Path,
) -> None:
    """Issue 50: a plan's calibration trips the launcher's first-step hook (under --strict,
    exit 2 before the script read its sizes). One process through the launcher's wrapper,
    no torchrun: the wrapper runs as ``__main__`` only when started so, and the hook it arms
    must be the one evendp's calibration holds back (tests/planning/test_calibrate.py checks
    the hook in this process)."""
    script = tmp_path / "plans_first.py"
    script.write_text(_PLANS_FIRST)
    (tmp_path / "outcome").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVENDP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    env |= {"EVENDP_BATCH_SIZES": "4", "EVENDP_STRICT": "1", "RANK": "0", "OMP_NUM_THREADS": "1"}
    env["EVENDP_OUTCOME"] = str(tmp_path / "outcome" / "outcome.json")
    cmd = [sys.executable, "-m", "evendp._distributed._first_step", str(script)]
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "trained\n", proc.stdout + proc.stderr
    assert proc.stderr == ""  # neither told nor warned (runpy's, of a module imported twice)
    assert not (tmp_path / "outcome" / "outcome.json").exists()  # no exit 2 for the launcher
