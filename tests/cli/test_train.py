"""`evendp train`: the demo trains, the loss falls, the report is written, resume continues."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from evendp.cli import main

CPU3 = ["--devices", "cpu,cpu,cpu"]  # what the demo runs where no GPU exists; never a GPU
SMALL = ["--n-layer", "1", "--n-embd", "32", "--block-size", "32", "--max-chars", "600000"]
# Budgets for SMALL's devices: an even split of 32 (10 on cpu:2) does not fit the small one.
BUDGETS = ["--memory", "4MiB,4MiB,1MiB"]


@pytest.fixture(autouse=True)
def keep_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """One 60-step run on three budgeted virtual CPU devices, shared by the checks below.

    ``--devices cpu,cpu,cpu`` (the default only where CUDA is absent) keeps it on the CPU on
    a GPU host too, where the default would be every GPU."""
    out = tmp_path_factory.mktemp("demo")
    capture = tmp_path_factory.mktemp("demo-stdout") / "stdout.txt"  # --out holds the run alone
    import contextlib

    with capture.open("w") as f, contextlib.redirect_stdout(f):
        code = main(
            ["train", "--steps", "60", "--out", str(out), "--no-progress", "--log-to", "csv",
             *CPU3, *SMALL, *BUDGETS]
        )  # fmt: skip
    assert code == 0
    return out, capture.read_text()


def test_loss_falls_clearly(demo: tuple[Path, str]) -> None:
    out, _ = demo
    report = json.loads((out / "report.json").read_text())
    losses = report["losses"]
    assert len(losses) == 60 and report["steps"] == 60
    assert sum(losses[-10:]) / 10 < losses[0] - 1.0  # ~4.5 (uniform over 96) -> below 3.5


def test_report_files_and_per_device_counts(demo: tuple[Path, str]) -> None:
    out, stdout = demo
    assert (out / "report.png").read_bytes()[:4] == b"\x89PNG"
    assert (out / "ckpt.pt").exists()
    split = json.loads((out / "report.json").read_text())["devices"]
    shares = [round(d["samples_per_step"]) for d in split]
    assert f"samples per device per step {shares} (the planner's split" in stdout
    assert shares[2] < 10 < max(shares)  # the small device gets less than an even share
    # The demo proves its own claim: on the first shuffled batch, the split's token-weighted
    # gradient is one device's on the whole batch.
    check = next(line for line in stdout.splitlines() if "exactness check" in line)
    assert "first (shuffled) batch" in check and "padding ignored" in check
    assert float(check.rsplit(" ", 1)[1]) <= 1e-5
    report = json.loads((out / "report.json").read_text())
    assert "cpu:2" in (out / "report.txt").read_text()
    assert report["model"].startswith("char GPT 1x32")


def test_budgets_even_split_fails_and_ours_fits(demo: tuple[Path, str]) -> None:
    out, stdout = demo
    assert "the even split [11, 11, 10] (what nn.DataParallel runs) fails: virtual device " \
        "cpu:2 is out of its 1.0 MiB budget" in stdout  # fmt: skip
    devices = json.loads((out / "report.json").read_text())["devices"]
    assert [d["even_oom"] for d in devices] == [False, False, True]
    for d in devices:  # measured within every budget; planned figures labelled as planned
        assert d["peak_kind"] == "forward" and d["peak_bytes"] <= d["budget_bytes"]
        assert d["planned_bytes"] and d["even_planned_bytes"]
    assert devices[2]["even_forward_peak_bytes"] > devices[2]["budget_bytes"]


def test_metrics_csv_has_one_row_per_step(demo: tuple[Path, str]) -> None:
    out, _ = demo
    rows = (out / "metrics.csv").read_text().splitlines()
    losses = json.loads((out / "report.json").read_text())["losses"]
    assert rows[0].startswith("step,loss,lr") and len(rows) == 61
    assert [float(r.split(",")[1]) for r in rows[1:]] == pytest.approx(losses)


def test_even_weights_on_budgets_re_split_on_out_of_memory(tmp_path: Path) -> None:
    # Forcing the even split onto the budgets: the small device really runs out, and the
    # Trainer's OOM re-split runs its share as micro-batches; the step still completes.
    code = main(
        ["train", "--steps", "2", "--weights", "1,1,1", "--out", str(tmp_path), "--no-progress",
         "--no-plan", *CPU3, *SMALL, *BUDGETS]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["resplits"] >= 1 and report["skipped_steps"] == 0 and report["steps"] == 2


def test_resume_continues_the_run(demo: tuple[Path, str]) -> None:
    out, _ = demo
    before = json.loads((out / "report.json").read_text())["losses"]
    code = main(
        ["train", "--steps", "65", "--resume", "--out", str(out), "--no-progress", "--no-plan",
         *CPU3, *SMALL, *BUDGETS]
    )  # fmt: skip
    assert code == 0
    after = json.loads((out / "report.json").read_text())
    assert after["steps"] == 65 and after["losses"][:60] == before


def test_bf16_and_accumulation_run(tmp_path: Path) -> None:
    code = main(
        ["train", "--steps", "4", "--amp", "bf16", "--accum", "2", "--devices", "cpu,cpu",
         "--weights", "3,1", "--out", str(tmp_path), "--no-progress", "--no-plan", *SMALL]
    )  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["amp"] == "bf16" and [d["samples_per_step"] for d in report["devices"]] == [
        24,
        8,
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be an int in [1, 10000000], got '0'"),
        (["--devices", "cpu,cpu", "--weights", "1,2,3"], "3 numbers for 2 devices"),
        (["--weights", "a,b,c"], "not a list of numbers"),
        (["--resume", "--out", "{tmp}/nothing.pt/x"], None),
    ],
)
def test_bad_input_exits_2_with_a_clear_message(
    argv: list[str], message: str | None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if message is None:  # a corrupt checkpoint to resume from
        bad = tmp_path / "run"
        bad.mkdir()
        (bad / "ckpt.pt").write_bytes(b"garbage")
        argv = ["--resume", "--out", str(bad)]
        message = "unreadable"
    common = ["--steps", "2", "--out", str(tmp_path / "out"), "--no-progress", "--no-plan", *CPU3]
    code = main(["train", *common, *SMALL, *argv])  # argv last: its values win
    assert code == 2
    assert message in capsys.readouterr().err


def _assert_uneven_launch(report: dict[str, Any], mode: str) -> None:
    assert report["mode"] == mode and report["steps"] == 3
    assert [d["samples_per_step"] for d in report["devices"]] == [12, 4]


@pytest.mark.multiprocess
def test_ddp_modes_launch_uneven_cpu_ranks_fsdp2(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["train", "--mode", "fsdp2", "--devices", "cpu,cpu", "--weights", "3,1", "--batch", "16",
         "--steps", "3", "--out", str(tmp_path), "--no-progress", *SMALL]
    )  # fmt: skip
    assert code == 0
    assert "no rank read" not in capfd.readouterr().err  # the ranks train with its sizes
    _assert_uneven_launch(json.loads((tmp_path / "report.json").read_text()), "fsdp2")


# The ddp launch on uneven ranks and its resume: test_train_faults.py, whose chain of
# launches runs the same uneven (3:1) split.


def test_planner_split_favours_the_device_with_more_memory() -> None:
    import argparse

    from evendp.cli._train_local import _planner_weights
    from evendp.examples.gpt import GPTConfig

    config = GPTConfig(vocab_size=96, block_size=32, n_layer=1, n_head=4, n_embd=32)
    args = argparse.Namespace(batch=64, amp="none", checkpointing=False)
    # 512 MiB CUDA context each, and what the CUDA allocator reserves beyond the tensors (two
    # 32 MiB cuBLAS workspaces, segments, the fragmentation allowance): the second device
    # cannot hold an even 32, so it gets what it holds and the first the rest; with room for
    # 32 on both the split is even (fastest).
    weights = _planner_weights(config, args, "640MiB,617MiB").split
    assert sum(weights) == 64 and weights[0] > weights[1] > 0
    assert _planner_weights(config, args, "640MiB,620MiB").split == [32, 32]


@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        # GPU indices reach the launch planner (not only their count).
        ("2,3", {"nproc": 2, "gpu_ids": [2, 3]}),
        ("cuda:1", {"nproc": 1, "gpu_ids": [1]}),
        # cpu entries force CPU ranks: NVML is not asked, so no GPU rank starts.
        ("cpu,cpu", {"nproc": 2, "gpu_ids": None, "nvml": False}),
    ],
)
def test_ddp_devices_reach_the_launch_plan(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, devices: str, expected: dict[str, object]
) -> None:
    import evendp._planning._launch

    monkeypatch.chdir(tmp_path)  # the default --out: nothing lands in the checkout
    seen: dict[str, object] = {}
    real = evendp._planning._launch.plan_launch

    def fake_plan_launch(**kwargs: object) -> object:
        seen.update(kwargs)
        return real(nproc=kwargs["nproc"], batch=8, nvml=False)

    def fake_launch(script: str, argv: list[str], plan: object, **_: object) -> tuple[int, None]:
        seen["argv"] = argv
        return 0, None

    monkeypatch.setattr(evendp._planning._launch, "plan_launch", fake_plan_launch)
    monkeypatch.setattr(evendp._planning._launch, "launch_with_outcome", fake_launch)
    assert main(["train", "--mode", "ddp", "--devices", devices, "--batch", "8"]) == 0
    for key, value in expected.items():
        assert seen[key] == value
    # CPU ranks are told so: they must not take the GPUs they can see.
    argv = seen["argv"]
    assert isinstance(argv, list)
    assert ("--devices" in argv) == ("nvml" in expected)


def test_ddp_rejects_mixed_devices(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--mode", "ddp", "--devices", "cpu,1"]) == 2
    assert "cpu,cpu for CPU ranks" in capsys.readouterr().err


def test_cpu_devices_keep_the_demo_on_the_cpu_on_a_gpu_host(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # A GPU host as the CLI sees it (the default --devices would be every GPU): with
    # --devices cpu,cpu,cpu, as the fixtures above pass, nothing touches CUDA, which on this
    # CPU build would raise "Torch not compiled with CUDA enabled".
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    argv = ["train", "--steps", "1", "--out", str(tmp_path), "--no-progress", "--no-plan"]
    assert main([*argv, *CPU3, *SMALL]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert [d["name"] for d in report["devices"]] == ["cpu:0", "cpu:1", "cpu:2"]


def test_declared_memory_allows_a_cuda_context_on_gpus_only() -> None:
    import argparse

    from evendp.cli._train_local import _planner_weights
    from evendp.examples.gpt import GPTConfig

    config = GPTConfig(vocab_size=96, block_size=32, n_layer=1, n_head=4, n_embd=32)
    args = argparse.Namespace(batch=None, amp="none", checkpointing=False, memory=None)
    memory = [640 * 2**20, 640 * 2**20]
    on_cpu = _planner_weights(config, args, memory, cpu=True)
    on_gpus = _planner_weights(config, args, memory, cpu=False)  # 512 MiB of it is CUDA's
    assert on_cpu.global_batch > on_gpus.global_batch > 0
