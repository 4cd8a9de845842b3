"""The claims only a GPU can check (``pytest -m gpu``; each test skips without CUDA). This module
imports nothing beyond torch, evendp and pytest, so it runs on a bare GPU machine.

- The Trainer trains a model built on the CPU on ``cuda:0`` (it moves the model there, the
  optimizer built before still steps it) as one device does on the whole batch, in fp32,
  bf16 and fp16.
- ``weights="auto"`` plans a model that sits on the GPU (it failed on fake tensors before).
- A planned batch trains under an allocator capped at the memory the plan was made for.
- Under NCCL the Trainer moves a rank's model to the rank's GPU.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import evendp
from evendp import BalancedDataParallel, TrainConfig, Trainer
from tests._helpers import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

SAMPLES = 24
# The gradient is one device's on the whole batch up to the precision's own round-off: fp32
# as everywhere; under autocast each device's share rounds its matmuls' outputs (bf16 keeps 8
# bits, fp16 11), and a share counted twice or weighted wrongly is off by more than 10%.
TOLERANCE = {"none": 1e-5, "bf16": 2e-2, "fp16": 4e-3}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 4))


def _data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(SAMPLES, 16, generator=g), torch.randn(SAMPLES, 4, generator=g)
    )


def _mse(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return F.mse_loss(model(batch[0]).float(), batch[1])


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().flatten().cpu() for p in model.parameters()])


def _one_sgd_step(model: nn.Module, device_ids: list[str], weights: list[float] | None,
                  amp: str) -> torch.Tensor:  # fmt: skip
    """The update of one step of SGD (lr 1): minus the step's gradient."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # before the Trainer moves it
    before = _flat(model)
    cfg = TrainConfig(steps=1, batch_size=SAMPLES, amp=amp, grad_clip=None, progress=False)
    Trainer(model, _data(), cfg, device_ids=device_ids, weights=weights, loss_fn=_mse,
            optimizer=optimizer).fit()  # fmt: skip
    return _flat(model) - before


@pytest.mark.parametrize("amp", ["none", "bf16", "fp16"])
def test_the_trainer_trains_a_cpu_model_on_cuda_as_one_device(
    amp: str, capsys: pytest.CaptureFixture[str]
) -> None:
    reference = _one_sgd_step(_model().cuda(), ["cuda:0"], None, amp)
    capsys.readouterr()
    model = _model()  # on the CPU: the Trainer moves it
    update = _one_sgd_step(model, ["cuda:0", "cuda:0"], [2, 1], amp)
    assert "evendp: the model was on cpu; moved it to cuda:0 (device_ids[0])" in (
        capsys.readouterr().err
    )
    assert next(model.parameters()).device == torch.device("cuda", 0)
    assert reference.norm() > 0  # the step ran (fp16's scaler did not skip it)
    error = float((update - reference).norm() / reference.norm())
    assert error <= TOLERANCE[amp], error


def test_weights_auto_plans_a_model_that_sits_on_the_gpu() -> None:
    model = _model().cuda()
    x = torch.randn(64, 16, device="cuda")
    wrapped = BalancedDataParallel(model, ["cuda:0", "cuda:0"], weights="auto")
    weights = wrapped.plan_weights(x)
    assert len(weights) == 2 and min(weights) > 0
    planned = evendp.plan(model, torch.randn(2, 16), ["1GiB"], mode="ddp")
    assert planned.devices[0].max_batch_alone > 0
    assert {p.device for p in model.parameters()} == {torch.device("cuda", 0)}  # untouched
    cfg = TrainConfig(steps=2, batch_size=SAMPLES, progress=False)
    report = Trainer(model, _data(), cfg, device_ids=["cuda:0", "cuda:0"], weights="auto",
                     loss_fn=_mse).fit()  # fmt: skip
    assert report.final_loss is not None


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(64, 10),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,))


@pytest.fixture
def capped() -> Iterator[None]:
    """The process's caching allocator starts empty and ends uncapped."""
    gc.collect()
    torch.cuda.empty_cache()
    yield
    torch.cuda.set_per_process_memory_fraction(1.0, 0)
    gc.collect()
    torch.cuda.empty_cache()


def test_a_planned_batch_trains_under_the_memory_it_was_planned_for(capped: None) -> None:
    memory, context = 2 << 30, 512 << 20  # a 2 GiB device whose CUDA context takes 512 MiB
    planned = evendp.plan(
        _ConvNet, _images, [memory], mode="ddp", criterion=F.cross_entropy,
        gradient_as_bucket_view=True, cuda_context=context,  # a plain loop: no DDP buckets
    )  # fmt: skip
    n = planned.devices[0].max_batch_alone
    assert n > 0
    held = torch.cuda.memory_reserved(0)  # anything an earlier test left cached
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction((memory - context + held) / total, 0)
    model = _ConvNet().cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    x, y = (t.cuda() for t in _images(n))
    for _ in range(2):  # the second step holds AdamW's state too
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()


def test_under_nccl_the_trainer_moves_the_model_to_the_rank_gpu(
    capsys: pytest.CaptureFixture[str],
) -> None:
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))  # fmt: skip
    model = _model()  # on the CPU
    cfg = TrainConfig(steps=2, batch_size=SAMPLES, progress=False)
    report = Trainer(model, _data(), cfg, loss_fn=_mse).fit()
    assert "moved it to cuda:0 (this rank's GPU)" in capsys.readouterr().err
    assert next(model.parameters()).device == torch.device("cuda", 0)
    assert report.final_loss is not None
