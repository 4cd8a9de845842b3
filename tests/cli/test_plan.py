"""``evendp plan`` on the command line: JSON, table, plot, and exit code 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from evendp.cli import main
from evendp.cli._model_spec import resolve_model


def test_json_lm_head(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["plan", "--model", "lm-head", "--memory", "3x80GiB", "--batch", "32", "--json"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert sum(data["split"]) == 32
    assert data["devices"][0]["breakdown"]["gathered_outputs"] == 1_280_000_000


def test_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "plan.png"
    args = [
        "plan",
        "--model",
        "lm-head",
        "--vocab",
        "1000",
        "--seq-len",
        "32",
        "--memory",
        "2GiB,1GiB",
        "--mode",
        "ddp",
        "--plot",
        str(png),
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "predicted peak" in out and "dev1" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


BUILDS = [0]


class _WithExample(nn.Linear):
    def example_batch(self, n: int) -> torch.Tensor:
        return torch.randn(n, 8)


def counted_model() -> nn.Module:
    BUILDS[0] += 1
    return _WithExample(8, 2)


def test_model_with_example_batch_is_not_rebuilt_per_batch(
    capsys: pytest.CaptureFixture[str],
) -> None:
    BUILDS[0] = 0
    spec = resolve_model("tests.cli.test_plan:counted_model")
    assert [tuple(spec.batch(n).shape) for n in (1, 2, 3)] == [(1, 8), (2, 8), (3, 8)]
    assert BUILDS[0] == 1  # the probe only
    argv = ["plan", "--model", "tests.cli.test_plan:counted_model", "--memory", "1GiB"]
    assert main([*argv, "--batch", "16", "--json"]) == 0
    assert sum(json.loads(capsys.readouterr().out)["split"]) == 16


def bad_factory() -> object:
    raise RuntimeError("broken on purpose")


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--memory", "24 furlongs"], "cannot read device entry"),
        (["--model", "lm-head", "--memory", "1GiB"], "not even one sample"),
        (["--model", "tests.cli.test_plan:bad_factory", "--memory", "8GiB"], "broken on purpose"),
        (["--model", "no_such_pkg.mod:f", "--memory", "8GiB"], "cannot load"),
        (["--model", "nonsense", "--memory", "8GiB"], "package.module:factory"),
    ],
)
def test_bad_input_exits_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err


def test_the_old_devices_flag_is_refused_naming_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "--model", "tests.cli.test_plan:counted_model", "--devices", "1GiB"]) == 2
    assert capsys.readouterr().err == (
        "evendp plan: error: unknown option --devices (did you mean --memory?); "
        "see 'evendp plan --help'\n"
    )


def test_missing_memory_on_a_cpu_machine_names_the_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # skip NVML: no GPU here
    assert main(["plan", "--model", "tests.cli.test_plan:counted_model"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--memory 24GiB,24GiB,12GiB" in err
    assert "memory='" not in err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--batch", "0"], "--batch must be an int in [1, 1000000000], got '0'; e.g. --batch 64"),
        (["--margin", "1.5"], "--margin must be a number in [0, 0.99], got '1.5'"),
        (["--context", "lots"], "--context 'lots' is not a size; e.g. --context 512MiB"),
    ],
)
def test_bad_options_are_named_by_their_flags(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model = ["--model", "tests.cli.test_plan:counted_model", "--memory", "1GiB"]
    assert main(["plan", *model, *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err
    assert "batch_size" not in err and "safety_margin" not in err and "cuda_context" not in err


def test_no_grad_plans_the_builtin_gpt_forward_only(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--no-grad", "--memory", "24GiB,24GiB,12GiB", "--model", "gpt", "--json"]
    assert main(args) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["no_grad"] is True and sum(data["split"]) == data["global_batch"]
    # Without gradients, optimizer state or saved activations each device holds far more.
    assert data["global_batch"] >= 1.5 * data["training"]["global_batch"]


MODELS_PY = """
import torch

def make_model():
    return torch.nn.Linear(8, 2), lambda n: torch.randn(n, 8)
"""


def test_model_from_a_python_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "my_models.py").write_text(MODELS_PY)
    monkeypatch.chdir(tmp_path)
    argv = ["plan", "--memory", "1GiB", "--batch", "16", "--json", "--model"]
    assert main([*argv, "lib/my_models.py:make_model"]) == 0
    assert sum(json.loads(capsys.readouterr().out)["split"]) == 16
    # A name the file does not define: the ones it does, and the closest as the fix.
    assert main([*argv, "lib/my_models.py:make_modle"]) == 2
    err = capsys.readouterr().err
    assert "lib/my_models.py has no 'make_modle' (it defines: make_model)" in err
    assert "did you mean --model lib/my_models.py:make_model?" in err
    assert main([*argv, "nowhere.py:make_model"]) == 2
    assert "no file" in capsys.readouterr().err
    assert main([*argv, "lib/my_models.py"]) == 2
    assert "add it after a colon, e.g. --model lib/my_models.py:make_model" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_failing_factory_is_named_by_its_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """issue 36: a factory that raised showed no file or line; now the line in the user's
    file (not torch's, not evendp's), in one line, for plan/launch and train --model."""
    user = tmp_path / "mine.py"
    user.write_text("import torch\n\ndef make():\n    return torch.nn.Linear(3, 'four')\n")
    rest = {
        "plan": ["--memory", "1GiB", "--context", "0", "--json"],
        "train": ["--memory", "1MiB", "--out", str(tmp_path / "out")],
    }[command]
    assert main([command, "--model", f"{user}:make", *rest]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f" at {user}:4 in make: TypeError" in err, err


def test_each_factory_shape_refused_where_it_does_not_belong_names_the_other(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """issue 36: train --model takes (model, dataset), plan/launch --model (model, batch_fn);
    each refusal of the other's shape says which command takes it."""
    user = tmp_path / "shapes.py"
    user.write_text(
        "import torch\n"
        "def for_plan():\n    return torch.nn.Linear(3, 2), lambda n: torch.randn(n, 3)\n"
        "def for_train():\n"
        "    return torch.nn.Linear(3, 2), torch.utils.data.TensorDataset(torch.randn(8, 3))\n"
    )
    out = str(tmp_path / "out")
    assert main(["train", "--model", f"{user}:for_plan", "--memory", "1MiB", "--out", out]) == 2
    said = capsys.readouterr().err
    assert "(model, batch_fn), what it returned, is what plan and launch --model take" in said
    assert main(["plan", "--model", f"{user}:for_train", "--memory", "1GiB", "--json"]) == 2
    said = capsys.readouterr().err
    assert "a dataset, what evendp train --model takes; plan and launch --model need" in said


def test_evendp_traceback_shows_the_whole_stack_before_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """issue 36: no switch showed the traceback behind a one-line error."""
    user = tmp_path / "mine.py"
    user.write_text("import torch\n\ndef make():\n    return torch.nn.Linear(3, 'four')\n")
    monkeypatch.setenv("EVENDP_TRACEBACK", "1")
    assert main(["plan", "--model", f"{user}:make", "--memory", "1GiB", "--json"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and f'File "{user}", line 4, in make' in err
    assert err.strip().splitlines()[-1].startswith("evendp plan: error: the model factory")
