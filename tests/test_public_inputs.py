"""Every public callable of ``evendp.__all__`` fed wrong types and values, one argument at a time.

Each case is a valid call; hypothesis replaces one of its arguments with a value from a pool of
the usual mistakes (a string for a number, NaN, a negative count, a flag, a container, a tensor
of the wrong shape). The answer must be an :class:`evendp.EvendpError` or a documented result,
never another exception type, a NaN or a hang (each example runs under an alarm).

Not fed: the records evendp builds and returns (``Plan``, ``DevicePlan``, ``TrainReport``,
``DeviceInfo``, ``Predictions``, ``Scattered``, ``StepLayout``), the error classes, and test
seams (``nvml=``).
"""

from __future__ import annotations

import math
import os
import signal
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import evendp
from evendp import EvendpError
from tests.planning.test_devices import FakeGpu, FakeNvml, GiB

# The usual mistakes; some are valid for some arguments (then the call must simply work).
JUNK: list[Any] = [
    None,
    True,
    -1,
    0,
    1.5,
    float("nan"),
    float("inf"),
    "x",
    "3,5",
    [],
    [-1],
    ["a"],
    {},
    object(),
    torch.tensor(float("nan")),
    torch.tensor(-2.0),
    torch.tensor([1.0, 2.0]),
]

NOT_FED = {
    "Plan",
    "DevicePlan",
    "TrainReport",
    "DeviceInfo",
    "Predictions",
    "Scattered",
    "StepLayout",
}


class _Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 12) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 2, generator=g), torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class _Regress(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.lin(x), y)


def _nvml(pci_order: bool = False) -> FakeNvml:
    if pci_order:  # CUDA numbers GPUs as NVML does (conftest restores the variable)
        os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return FakeNvml([FakeGpu("A", 16 * GiB, 1 * GiB), FakeGpu("B", 16 * GiB, 2 * GiB)])


# The module's scratch folder (set by the _scratch fixture, removed when the module ends): a
# case's files land in a fresh folder inside it, never loose in the temp folder.
_ROOT: list[Path] = []


@pytest.fixture(autouse=True, scope="module")
def _scratch() -> Iterator[None]:
    with tempfile.TemporaryDirectory(prefix="evendp-inputs-") as root:
        _ROOT[:] = [Path(root)]
        try:
            yield
        finally:
            _ROOT.clear()


def _tmp() -> Path:
    return Path(tempfile.mkdtemp(dir=_ROOT[0]))


# name -> (callable, positional arguments, keyword arguments, arguments hypothesis replaces)
Case = tuple[Callable[..., Any], list[Any], dict[str, Any]]


def _cases() -> dict[str, Callable[[], Case]]:
    return {
        "BalancedDataParallel": lambda: (
            evendp.BalancedDataParallel,
            [nn.Linear(2, 2)],
            {
                "device_ids": ["cpu", "cpu"],
                "output_device": None,
                "dim": 0,
                "weights": [1, 1],
                "gather_output": True,
                "count_fn": None,
            },
        ),
        "ParallelCriterion": lambda: (
            evendp.ParallelCriterion,
            [nn.MSELoss()],
            {"reduction": "mean", "count_fn": None},
        ),
        "gather": lambda: (evendp.gather, [None], {}),
        "split_sizes": lambda: (evendp.split_sizes, [10, [1, 2]], {}),
        "count_tokens": lambda: (
            evendp.count_tokens,
            [],
            {"shift": True, "ignore_index": -100, "key": "labels"},
        ),
        "padded_cost": lambda: (evendp.padded_cost, [[3, 5]], {"padded": True}),
        "split_by_cost": lambda: (
            evendp.split_by_cost,
            [[3, 5, 2], [1, 1]],
            {"padded": True, "max_sizes": None, "max_costs": None},
        ),
        "predict": lambda: (
            evendp.predict,
            [nn.Linear(2, 2), torch.randn(6, 2)],
            {
                "device_ids": ["cpu"],
                "weights": None,
                "batch_size": 4,
                "collate_fn": None,
                "inference_mode": True,
            },
        ),
        "EmptySafeCollate": lambda: (evendp.EmptySafeCollate, [_Pairs()], {"collate_fn": None}),
        "UnevenBatchSampler": lambda: (
            evendp.UnevenBatchSampler,
            [range(10), [2, 3]],
            {
                "rank": 0,
                "world_size": 2,
                "shuffle": True,
                "seed": 0,
                "drop_last": False,
                "costs": None,
                "padded": True,
                "group_steps": 1,
                "max_costs": None,
            },
        ),
        "batch_sizes_from_env": lambda: (
            evendp.batch_sizes_from_env,
            [2],
            {"var": "EVENDP_BATCH_SIZES", "default": [1, 2], "environ": {}},
        ),
        "ddp_loss": lambda: (evendp.ddp_loss, [torch.tensor(3.0), 3, 6], {}),
        "global_count": lambda: (evendp.global_count, [3], {"device": None}),
        "global_mean": lambda: (evendp.global_mean, [torch.tensor(3.0), 3], {}),
        "init_distributed": lambda: (evendp.init_distributed, ["mpi"], {}),
        "finish_distributed": lambda: (evendp.finish_distributed, [], {}),
        "parse_batch_sizes": lambda: (evendp.parse_batch_sizes, ["3,5", 2], {}),
        "settle_group": lambda: (evendp.settle_group, [], {"collect": True}),
        "layout_step": lambda: (
            evendp.layout_step,
            [[0, 1, 2, 3, 4], [2, 3]],
            {"costs": None, "padded": True, "max_costs": None},
        ),
        "config_micro_batch": lambda: (evendp.config_micro_batch, [[2, 3]], {}),
        "label_shift": lambda: (evendp.label_shift, [_Regress()], {}),
        "planned_rank_sizes": lambda: (
            evendp.planned_rank_sizes,
            [_Regress, lambda: (torch.randn(1, 2), torch.randn(1, 2)), 6],
            {"memory": "64MiB"},
        ),
        "DeviceMemory": lambda: (evendp.DeviceMemory, ["a", 100, 200], {}),
        "live_memory": lambda: (evendp.live_memory, [[0]], {"nvml": _nvml(pci_order=True)}),
        "parse_memory": lambda: (evendp.parse_memory, ["2x24GiB"], {}),
        "plan": lambda: (
            evendp.plan,
            [nn.Linear(2, 2), torch.randn(4, 2), "1GiB,1GiB"],
            {
                "mode": "dp",
                "batch_size": None,
                "safety_margin": 0.05,
                "output_device": 0,
                "cuda_context": 0,
                "no_grad": False,
                "seq_len": None,
                "gather_output": True,
                "checkpointing": False,
            },
        ),
        "SpeedBalancer": lambda: (
            evendp.SpeedBalancer,
            [[4, 4]],
            {"caps": None, "warmup": 3, "every": 1, "window": 5, "tolerance": 0.05, "min_size": 1},
        ),
        "balance_sizes": lambda: (
            evendp.balance_sizes,
            [10, [0.1, 0.2]],
            {"caps": None, "min_size": 0},
        ),
        "list_devices": lambda: (evendp.list_devices, [], {"nvml": _nvml()}),
        "select_devices": lambda: (
            evendp.select_devices,
            [],
            {"count": None, "gpu_ids": [0], "min_free": None, "nvml": _nvml()},
        ),
        "OomResplit": lambda: (
            evendp.OomResplit,
            [],
            {"micro_batch_size": None, "min_micro_batch_size": 1, "catch": True, "devices": 1},
        ),
        "TrainConfig": lambda: (
            evendp.TrainConfig,
            [],
            {
                "steps": 2,
                "batch_size": 4,
                "batch_sizes": None,
                "accum": 1,
                "lr": 1e-3,
                "weight_decay": 0.0,
                "grad_clip": 1.0,
                "amp": "none",
                "activation_checkpointing": False,
                "oom_resplit": True,
                "strategy": "ddp",
                "out_dir": None,
                "checkpoint_every": 0,
                "resume": False,
                "seed": 0,
                "progress": False,
                "prefetch": None,
                "eval_every": 0,
            },
        ),
        "Trainer": lambda: (
            evendp.Trainer,
            [_Regress(), _Pairs(), evendp.TrainConfig(steps=1, batch_size=4, progress=False)],
            {
                "device_ids": ["cpu", "cpu"],
                "weights": [1, 1],
                "count_fn": None,
                "optimizer": None,
                "scheduler": None,
                "eval_data": None,
                "eval_fn": None,
                "costs": None,
                "collate_fn": None,
                "max_costs": None,
                "counts": None,
            },
        ),
        "save_checkpoint": lambda: (
            evendp.save_checkpoint,
            [_tmp() / "ckpt.pt"],
            {
                "model": nn.Linear(2, 2),
                "optimizer": None,
                "scheduler": None,
                "step": 0,
                "extra": None,
            },
        ),
        "StepMean": lambda: (evendp.StepMean, [], {"count_fn": None, "group": None}),
        "EngineMean": lambda: (evendp.EngineMean, [_Engine()], {"count_fn": None, "group": None}),
        "is_stand_in": lambda: (evendp.is_stand_in, [torch.ones(2)], {}),
        "share_loss": lambda: (
            evendp.share_loss,
            [torch.tensor(0.5), 4, 0.125],
            {"stand_in": False},
        ),
        "rehearse": lambda: (
            evendp.rehearse,
            [_Regress(), _Pairs(), evendp.TrainConfig(steps=1, batch_size=4, progress=False)],
            {"memory": "2x64MiB", "scale": 1.0, "weights": [1, 1], "say": None},
        ),
        "Callback": lambda: (evendp.Callback, [], {}),
        "CSVLogger": lambda: (evendp.CSVLogger, [_tmp() / "metrics.csv"], {}),
        "TensorBoardLogger": lambda: (evendp.TensorBoardLogger, [_tmp() / "tb"], {}),
        "MLflowLogger": lambda: (
            evendp.MLflowLogger,
            [],
            {"tracking_uri": (_tmp() / "mlruns").as_uri(), "experiment": "e", "run_name": None},
        ),
        # wandb is not a test dependency: without it the answer is the install line.
        "WandbLogger": lambda: (evendp.WandbLogger, [], {"project": "p"}),
        "load_checkpoint": lambda: (
            evendp.load_checkpoint,
            [_saved()],
            {"model": nn.Linear(2, 2), "optimizer": None, "scheduler": None, "restore_rng": True},
        ),
    }


class _Engine:
    """What EngineMean reads of a DeepSpeed engine."""

    def gradient_accumulation_steps(self) -> int:
        return 1

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        pass


def _saved() -> Path:
    path = _tmp() / "ckpt.pt"
    evendp.save_checkpoint(path, model=nn.Linear(2, 2))
    return path


CASES = _cases()


@pytest.fixture(autouse=True, scope="module")
def _mlflow_file_store() -> Iterator[None]:
    """MLflow 3 refuses a file store unless told (docs/training.md says the same to users)."""
    before = os.environ.get("MLFLOW_ALLOW_FILE_STORE")
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    yield
    if before is None:
        os.environ.pop("MLFLOW_ALLOW_FILE_STORE", None)
    else:
        os.environ["MLFLOW_ALLOW_FILE_STORE"] = before


def test_every_public_callable_has_a_case() -> None:
    fed = set(CASES) | NOT_FED
    callables = {n for n in evendp.__all__ if not n.endswith("Error")}
    assert callables - fed == set()


class _Hang(Exception):
    pass


@contextmanager
def _alarm(seconds: int) -> Iterator[None]:
    def ring(signum: int, frame: Any) -> None:
        raise _Hang(f"no answer within {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextmanager
def _in_tmp_dir() -> Iterator[None]:
    before = os.getcwd()
    with tempfile.TemporaryDirectory(dir=_ROOT[0]) as tmp:
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(before)


def _finite(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    return True


# Test seams, not inputs: a stub NVML module. Callables left with no argument to feed.
SEAMS = {"nvml"}
NO_ARGUMENTS = {"finish_distributed", "list_devices", "Callback"}

# Documented answers that are not refusals: the loss value itself is the caller's and passes
# through (a NaN loss stays NaN, GradScaler's business); ``global_mean`` over no samples is
# NaN (its docstring); ``share_loss``'s mean is the caller's, and a tensor scale is never read
# on the host (a NaN one stays NaN); ``init_distributed(None)`` chooses a backend and then
# needs torchrun's variables (torch's own error); a list is a dataset to ``predict`` and what
# the model makes of its samples is the model's.
PASSED_THROUGH = {("ddp_loss", 0), ("global_mean", 0), ("global_mean", 1)}
PASSED_THROUGH |= {("share_loss", 0), ("share_loss", 2)}
SKIPPED = {("init_distributed", 0, "None"), ("predict", 1, "[-1]")}


def _slots(case: Case) -> list[int | str]:
    _, args, kwargs = case
    return [*range(len(args)), *(k for k in kwargs if k not in SEAMS)]


def call_with(name: str, slot: int | str, junk: Any) -> tuple[bool, Any]:
    """Call case ``name`` with ``junk`` in ``slot``: (refused with EvendpError, the result)."""
    fn, args, kwargs = CASES[name]()
    if isinstance(slot, int):
        args = [*args[:slot], junk, *args[slot + 1 :]]
    else:
        kwargs = {**kwargs, slot: junk}
    with _alarm(30), _in_tmp_dir():  # a string is a valid path: files land in a temp dir
        try:
            return False, fn(*args, **kwargs)
        except EvendpError:
            return True, None
        except evendp.NvmlUnavailableError:  # documented: no NVIDIA driver on this machine
            return True, None


@settings(max_examples=300)
@given(data=st.data())
def test_wrong_inputs_get_an_evendp_error_or_a_documented_answer(data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(set(CASES) - NO_ARGUMENTS)), label="callable")
    slot = data.draw(st.sampled_from(_slots(CASES[name]())), label="argument")
    junk = data.draw(st.sampled_from(JUNK), label="value")
    if (name, slot, repr(junk)) in SKIPPED:
        return
    _, result = call_with(name, slot, junk)
    if (name, slot) not in PASSED_THROUGH:
        assert _finite(result), f"{name}({slot}={junk!r}) returned {result!r}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_valid_case_runs(name: str) -> None:
    # The baseline each mutation starts from is itself a valid call (else a refusal proves
    # nothing); init_distributed's is the one case built to be refused.
    fn, args, kwargs = CASES[name]()
    refused = name in ("init_distributed", "gather")
    if name == "WandbLogger":  # refused with the install line where wandb is missing
        import importlib.util

        refused = importlib.util.find_spec("wandb") is None
    if refused:
        with pytest.raises(EvendpError):
            fn(*args, **kwargs)
        return
    fn(*args, **kwargs)
