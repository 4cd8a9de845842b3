"""Planning a model wherever its tensors sit: every planning surface, a model on ``meta`` or on
a GPU, against the same model built on the CPU.

A model on a GPU is stood in for by fake ``cuda`` tensors of a fake mode of the test's own
(this machine has no GPU): planning it failed exactly as on the H200 ("_apply(): Couldn't
swap Linear.weight"), as did a model on ``meta``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import evendp
from evendp._core._calls import as_args
from evendp._planning._balance import (
    ENV_MEMORY,
    device_sizes_for_memory,
    device_weights_for_memory,
    planned_rank_sizes,
    rank_batch_plan,
)
from evendp._planning._fake_model import fake_cpu_copy, off_cpu
from evendp._training._trainer import _LossModule, default_loss
from evendp.cli import main
from evendp.integrations._auto_sizes import auto_loader_sizes
from tests._helpers import tiny_gpt2_config

CPU2 = [torch.device("cpu")] * 2


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 4))


def _on_fake_cuda(model: nn.Module) -> nn.Module:
    """``model`` with every parameter and buffer replaced by a fake ``cuda`` tensor of the same
    shape (a mode of its own, not the planner's): what planning sees of a model on a GPU."""
    with FakeTensorMode():
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    fake = torch.empty(p.shape, dtype=p.dtype, device="cuda")
                    module._parameters[name] = nn.Parameter(fake, p.requires_grad)
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="cuda")
    return model


def _gpt2() -> nn.Module:
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(tiny_gpt2_config())


def _gpt2_on_meta() -> nn.Module:
    from transformers import GPT2LMHeadModel

    config = tiny_gpt2_config()
    with torch.device("meta"):  # as a user builds a model too large to build anywhere else
        return GPT2LMHeadModel(config)


def _mlp_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(*batch).square().mean()


def _tokens(n: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (n, 16))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


@dataclass(frozen=True)
class Case:
    elsewhere: Callable[[], nn.Module]  # the model off the CPU
    on_cpu: Callable[[], nn.Module]  # the same model built on the CPU
    batch: Callable[[int], Any]
    memory: str  # per device: small enough that the plan's sizes tell models apart
    factory: str  # for evendp plan --model: a factory module's source, building elsewhere
    loss_fn: Any = default_loss  # the Trainer's, for the Trainer's planning


MLP_FACTORY = """
import torch
from torch import nn

def make(on_cpu=False):
    with torch.device("cpu" if on_cpu else "meta"):
        model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 4))
    return model, lambda n: torch.randn(n, 64)
"""

GPT2_FACTORY = """
import torch
from transformers import GPT2LMHeadModel
from tests._helpers import tiny_gpt2_config

def make(on_cpu=False):
    with torch.device("cpu" if on_cpu else "meta"):
        model = GPT2LMHeadModel(tiny_gpt2_config())
    def batch(n):
        ids = torch.randint(0, 64, (n, 16))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    return model, batch
"""


def _features(n: int) -> torch.Tensor:
    return torch.randn(n, 64)


CASES = {
    "mlp on meta": Case(lambda: _mlp().to("meta"), _mlp, _features, "4MiB", MLP_FACTORY, _mlp_loss),
    "mlp on a GPU": Case(
        lambda: _on_fake_cuda(_mlp()), _mlp, _features, "4MiB", MLP_FACTORY, _mlp_loss
    ),
    "GPT-2 on meta": Case(_gpt2_on_meta, _gpt2, _tokens, "8MiB", GPT2_FACTORY),
}


def _plan(model: nn.Module, case: Case) -> Any:
    return evendp.plan(model, case.batch(2), [case.memory], mode="ddp", cuda_context=0).split


def _bdp_weights(model: nn.Module, case: Case) -> Any:
    # What BalancedDataParallel(weights="auto").plan_weights plans with its module.
    mem = f"{case.memory},{case.memory}"
    batch = case.batch(2)
    inputs = batch if isinstance(batch, dict) else (batch,)  # forward's kwargs, or its args
    return device_weights_for_memory(model, inputs, CPU2, memory=mem, environ={})[0]


def _trainer_weights(model: nn.Module, case: Case) -> Any:
    # The Trainer's weights="auto" (and batch_sizes="auto" in one process): its loss module.
    mem = f"{case.memory},{case.memory}"
    loss_module = _LossModule(model, case.loss_fn)
    batch = as_args(case.batch(2))
    return device_sizes_for_memory(loss_module, batch, CPU2, 24, memory=mem, environ={})[0]


def _rank_sizes(model: nn.Module, case: Case) -> Any:
    # TrainConfig(batch_sizes="auto") under torchrun: each rank's cap from its memory.
    return rank_batch_plan("auto", 8, 1, model=lambda: model, example=lambda: case.batch(1)).caps


def _uneven_trainer(model: nn.Module, case: Case) -> Any:
    # UnevenTrainer(batch_sizes="auto") plans its model on one collated sample.
    return planned_rank_sizes(model, lambda: case.batch(1), 8, memory=case.memory)[1]


def _uneven_dataloader(model: nn.Module, case: Case) -> Any:
    # The Accelerate and Lightning uneven_dataloader(batch_sizes="auto", model=...).
    one = case.batch(1)
    sample = {k: v[0] for k, v in one.items()} if isinstance(one, dict) else one[0]
    return auto_loader_sizes(
        [sample] * 4, model=model, batch_size=4, world=1, memory=case.memory, collate_fn=None
    )


SURFACES: dict[str, Callable[[nn.Module, Case], Any]] = {
    "evendp.plan": _plan,
    "BalancedDataParallel weights=auto": _bdp_weights,
    "Trainer weights=auto": _trainer_weights,
    "batch_sizes=auto per rank": _rank_sizes,
    "UnevenTrainer auto": _uneven_trainer,
    "uneven_dataloader auto": _uneven_dataloader,
}


# Every surface with the MLP off the CPU both ways; GPT-2 on meta on the surfaces a Hugging
# Face model meets (each GPT-2 plan costs seconds on 2 busy cores).
PAIRS = [(where, surface) for where in ("mlp on meta", "mlp on a GPU") for surface in SURFACES]
HF_SURFACES = ("evendp.plan", "Trainer weights=auto", "UnevenTrainer auto")
PAIRS += [("GPT-2 on meta", surface) for surface in HF_SURFACES]


@pytest.mark.parametrize(("where", "surface"), PAIRS)
def test_every_surface_plans_a_model_off_the_cpu_as_on_it(
    where: str, surface: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[where]
    monkeypatch.setenv(ENV_MEMORY, case.memory)
    model = case.elsewhere()
    before = {name: (t.device, type(t)) for name, t in model.state_dict().items()}
    got = SURFACES[surface](model, case)
    assert got == SURFACES[surface](case.on_cpu(), case)
    # The user's module is untouched: still where it was, the same kind of tensor.
    assert {name: (t.device, type(t)) for name, t in model.state_dict().items()} == before


def _planned_by_cli(factory: str, capsys: pytest.CaptureFixture[str], memory: str) -> Any:
    argv = ["plan", "--model", factory, "--memory", memory, "--context", "0", "--json"]
    assert main(argv) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["split"]


@pytest.mark.parametrize("where", ["mlp on meta", "GPT-2 on meta"])
def test_evendp_plan_model_plans_a_factory_that_builds_on_meta(
    where: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    case = CASES[where]
    (tmp_path / "factories.py").write_text(
        case.factory + "\n\ndef make_on_cpu():\n    return make(on_cpu=True)\n"
    )
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # tests._helpers imports
    factories = tmp_path / "factories.py"
    on_meta = _planned_by_cli(f"{factories}:make", capsys, case.memory)
    assert on_meta == _planned_by_cli(f"{factories}:make_on_cpu", capsys, case.memory)


def test_the_fake_copy_keeps_tied_weights_and_every_tensor_kind() -> None:
    model = _gpt2_on_meta()
    fake = fake_cpu_copy(model, FakeTensorMode())
    assert fake.lm_head.weight is fake.transformer.wte.weight  # tied, as in the original
    assert not off_cpu(fake) and off_cpu(model)
    assert [(n, t.shape, t.dtype) for n, t in fake.state_dict().items()] == [
        (n, t.shape, t.dtype) for n, t in model.state_dict().items()
    ]
    assert all(p.requires_grad for p in fake.parameters())
