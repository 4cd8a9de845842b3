"""Every size is bounded at the boundary (issue 28): device counts, ``Nx`` repeats, ``--nproc``,
batch sizes and every ``EVENDP_*`` variable get the command line's limits and one line, with
long values echoed cut short; host out-of-memory is the out-of-memory line. In-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from evendp._core._errors import EvendpError
from evendp._distributed._batch_plan import BatchPlan, batch_sizes_from_env
from evendp._planning._balance import rank_memory
from evendp.cli import main

HUGE = "1" + "0" * 26  # 10**26 samples


def _one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, (argv, captured.out[-500:], captured.err[-2000:])
    assert "Traceback" not in captured.err + captured.out
    errors = [line for line in captured.err.splitlines() if "error" in line]
    assert len(errors) == 1, captured.err[-2000:]
    return errors[0]


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan", "--memory", "1000000000x24GiB"], "use N in [1, 1000000]"),
        (["plan", "--memory", "600000x1GiB,600000x1GiB"], "1200000+ devices"),
        (["plan", "--memory", "1000000000000GiB"], "cannot read device entry"),
        (["launch", "--nproc", "1000000", "--dry-run", "t.py"], "at most 1024"),
        (["launch", "--nnodes", "1000000000", "--dry-run", "t.py"], "[1, 100000]"),
        (["launch", "--batch-sizes", f"3,{HUGE}", "--dry-run", "t.py"], "more than 1000000000"),
        # Issue 34: 30,000 sizes made a 30,000-rank plan; a port past 65535 went to torchrun;
        # 5,000 CPU devices were accepted and then ignored SIGTERM for minutes.
        (
            ["launch", "--batch-sizes", ",".join(["1"] * 30_000), "--dry-run", "t.py"],
            "30000 ranks per node, more than 1024",
        ),
        (["launch", "--master-port", "99999", "--dry-run", "t.py"], "[1, 65535], got '99999'"),
        (
            [
                "launch",
                "--nnodes",
                "2",
                "--node-rank",
                "-1",
                "--batch-sizes",
                "1,1",
                "--dry-run",
                "t.py",
            ],
            "--node-rank must be an int in [0, 99999]",
        ),
        (["train", "--devices", ",".join(["cpu"] * 5000)], "5000 devices, more than 1024"),
        (
            ["train", "--devices", "cpu", "--out", "runs/" + "a" * 300],
            "names are at most 255 bytes",
        ),
        (["train", "--devices", "cpu", "--out", "runs/bad\udcff\udcfe"], "in UTF-8 text"),
    ],
)
def test_sizes_past_the_limits_are_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    assert needle in _one_line(argv, capsys)


@pytest.mark.parametrize("value", ["x" * 400_000, "9" * 400_000, "1GiB," * 80_000 + "x"])
def test_a_400_kb_value_is_echoed_cut_short(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # "9" * 400_000 also took minutes before: a quadratic regex in the decimal-units notice.
    line = _one_line(["plan", "--memory", value], capsys)
    assert len(line) < 1000 and f"({len(value)} characters)" in line


@pytest.mark.parametrize(
    ("read", "env", "needle"),
    [
        (lambda: rank_memory(rank=0, world_size=2), {"EVENDP_MEMORY": "5000000x1GiB"}, "1000000"),
        (lambda: batch_sizes_from_env(), {"EVENDP_BATCH_SIZES": f"3,{HUGE}"}, "1000000000"),
        # The caps ride in EVENDP_BATCH_SIZES.
        (lambda: BatchPlan.from_env(), {"EVENDP_BATCH_SIZES": f"3,3;caps=3,{HUGE}"}, "1000000000"),
        (
            lambda: BatchPlan.from_env(),
            {"EVENDP_BATCH_SIZES": "3;caps=" + "7" * 100_000},
            "(100000 char",
        ),
    ],
)
def test_environment_variables_get_the_same_limits(
    read: object, env: dict[str, str], needle: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(EvendpError) as info:
        read()  # type: ignore[operator]
    message = str(info.value)
    assert needle in message and len(message) < 1000 and "\n" not in message


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        ('{"n_layer": 300}', "--n-layer must be an int in [1, 64], got '300'"),
        ("not json", "is not JSON"),
        ('["steps"]', "not a JSON object"),
        ('{"lr": "fast"}', "--lr must be a number in (0, 10], got 'fast'"),
        ('{"batch": 1e26}', "--batch must be an int in [1, 1000000]"),
        ('{"mode": "tpu"}', "--mode must be one of"),
        ('{"resume": "yes"}', "--resume must be true or false"),
        ('{"surprise": 1}', "unknown option 'surprise'"),
        ("[" * 100_000 + "]" * 100_000, "nested deeper than 32 levels"),  # was a RecursionError
    ],
)
def test_train_options_from_the_environment_are_checked_like_the_command_line(
    options: str, needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    monkeypatch.setenv("EVENDP_TRAIN_OPTIONS", options)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("EVENDP_OUTCOME", raising=False)
    line = _one_line(["train", "--out", str(tmp_path / "run")], capsys)
    assert "EVENDP_TRAIN_OPTIONS" in line and needle in line
    assert not (tmp_path / "run").exists()  # refused before any work


def test_host_out_of_memory_is_the_out_of_memory_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import evendp.cli.train as train

    def run(args: object) -> int:  # what torch's CPU allocator raises past the host's memory
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 1125899906842624 bytes. Error code 12 (Cannot "
            "allocate memory)"
        )

    monkeypatch.setattr(train, "_run", run)
    line = _one_line(["train", "--out", str(tmp_path / "run")], capsys)
    assert "out of memory" in line and "lower --batch" in line


@pytest.mark.parametrize(
    ("text", "needle"),
    [("[" * 100_000 + "]" * 100_000, "nested deeper than 32 levels"), (None, "is not a file")],
)
def test_a_strategy_config_too_deep_or_a_fifo_is_refused_before_any_launch(
    text: str | None, needle: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Issue 34: a deeply nested --strategy-config was a RecursionError in every rank; it and a
    FIFO in its place are one line from the launcher, before torchrun starts."""
    import os

    config = tmp_path / "ds.json"
    if text is None:
        os.mkfifo(config)
    else:
        config.write_text(text)
    argv = ["train", "--mode", "deepspeed", "--devices", "cpu,cpu", "--strategy-config",
            str(config), "--out", str(tmp_path / "run")]  # fmt: skip
    assert needle in _one_line(argv, capsys)
    assert not (tmp_path / "run").exists()
