"""The planner: device specs, the source material's logits case, accuracy against real runs,
eta_mem on heterogeneous devices, and bad input."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker

from evendp._core._errors import EvendpError, PlanError
from evendp._planning._measure import profile_step
from evendp._planning._memory import DeviceMemory, live_memory, parse_memory
from evendp._planning._planner import auto_weights, plan
from evendp.examples.gpt import GPT, GPTConfig
from evendp.examples.lm_head import LMHead, lm_loss
from tests.planning.test_devices import FakeGpu, FakeNvml, GiB


def test_parse_memory_entries() -> None:
    devs = parse_memory("24GiB, 24GiB-10GiB ,2x12GB,4096")
    assert [d.free for d in devs] == [24 << 30, 14 << 30, 12 * 10**9, 12 * 10**9, 4096]
    assert devs[1] == DeviceMemory("dev1", 14 << 30, 24 << 30)
    assert devs[1].used == 10 << 30


@pytest.mark.parametrize("spec", ["24 furlongs", "", "24GiB,,12GiB", "10GiB-24GiB", "0x8GiB"])
def test_parse_memory_rejects(spec: str) -> None:
    with pytest.raises(EvendpError):
        parse_memory(spec)


def _three_gpus() -> FakeNvml:
    return FakeNvml([FakeGpu("A", 16 * GiB, 1 * GiB), FakeGpu("B", 16 * GiB, 2 * GiB),
                     FakeGpu("C", 24 * GiB, 3 * GiB)])  # fmt: skip


def test_live_memory_follows_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    # In PCI bus order NVML ids are CUDA's physical ids: cuda:i is the i-th listed GPU.
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert [m.free for m in live_memory(nvml=_three_gpus())] == [1 * GiB, 2 * GiB, 3 * GiB]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    got = live_memory(nvml=_three_gpus())
    assert [(m.name, m.free) for m in got] == [("cuda:0", 3 * GiB), ("cuda:1", 1 * GiB)]
    assert [m.free for m in live_memory([1], nvml=_three_gpus())] == [1 * GiB]


def test_live_memory_with_no_visible_gpu_reports_none(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA_VISIBLE_DEVICES="" hides every GPU; it must not read as "all of them".
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(EvendpError, match="CUDA_VISIBLE_DEVICES is empty"):
        live_memory(nvml=_three_gpus())


def _lm_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 40_000, (n, 250)), torch.randint(0, 40_000, (n, 250))


def test_lm_head_logits_on_output_device() -> None:
    # The source material's case: 40,000 x 250 x 32 fp32 logits = 1.28e9 bytes, gathered and
    # differentiated on DP's output device; the other devices hold none of it.
    p = plan(
        lambda: LMHead(40_000, 250),
        _lm_batch,
        "3x80GiB",
        mode="dp",
        criterion=lm_loss,
        batch_size=32,
    )
    out = p.devices[0].breakdown
    assert out["gathered_outputs"] == 1_280_000_000
    assert out["gathered_grad"] == 1_280_000_000
    assert out["loss"] >= 1_280_000_000  # log-softmax output and its gradient
    assert all("gathered_outputs" not in d.breakdown for d in p.devices[1:])
    assert sum(p.split) == 32
    # DDP has no output device: each rank holds only its own share's logits.
    q = plan(
        lambda: LMHead(40_000, 250),
        _lm_batch,
        "3x80GiB",
        mode="ddp",
        criterion=lm_loss,
        batch_size=32,
    )
    assert all("gathered_outputs" not in d.breakdown for d in q.devices)
    assert q.devices[0].peak < p.devices[0].peak


def test_a_fixed_batch_is_even_where_it_fits_and_capped_where_it_does_not() -> None:
    # 50,000 samples on 24, 24, 12 GiB: an even 16,667 overflows the 12 GiB card (~15,000),
    # so it gets the most it holds and the other two share the rest evenly (the fastest split
    # that fits).
    p = plan(_small_gpt, _gpt_batch, "24GiB,24GiB,12GiB", mode="ddp", batch_size=50_000)  # type: ignore[arg-type]
    small = p.devices[2]
    assert sum(p.split) == 50_000
    assert p.split[2] == small.max_batch_alone < 16_667
    assert abs(p.split[0] - p.split[1]) <= 1
    assert all(d.peak <= d.budget for d in p.devices)
    assert small.even_peak > small.budget  # the even split would not fit
    q = plan(_small_gpt, _gpt_batch, "24GiB,24GiB,12GiB", mode="ddp", batch_size=300)  # type: ignore[arg-type]
    assert q.split == [100, 100, 100]  # fits everywhere: even, so no device is the bottleneck


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _real_forward_bytes(model: nn.Module, batch: object, sizes: tuple[int, int]) -> float:
    """Activation bytes per sample from MemTracker on real tensors (an independent path)."""
    held = []
    for n in sizes:
        torch.manual_seed(0)
        m = model
        tracker = MemTracker()
        tracker.track_external(m)
        with tracker:
            inputs = batch(n)  # type: ignore[operator]
            out = m(*inputs) if isinstance(inputs, tuple) else m(inputs)
            snap = tracker.get_tracker_snapshot()
            total = sum(v["Total"] for v in snap.values())
            params = sum(
                v.get(k, 0)
                for v in snap.values()
                for k in v
                if getattr(k, "name", "") in ("PARAM", "BUFFER")
            )
            held.append(total - params)
        del out
    return (held[1] - held[0]) / (sizes[1] - sizes[0])


FAMILIES = {
    "mlp": (
        lambda: nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)),
        lambda n: torch.randn(n, 64),
    ),
    "conv": (ConvNet, lambda n: torch.randn(n, 3, 32, 32)),
    "gpt": (
        lambda: GPT(GPTConfig(n_layer=2)),
        lambda n: (torch.randint(0, 96, (n, 64)), torch.randint(0, 96, (n, 64))),
    ),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_activation_bytes_per_sample_match_real_run(family: str) -> None:
    make, batch = FAMILIES[family]
    sizes = (4, 8)
    prof = profile_step(make, batch, sizes=sizes, optimizer=None)
    predicted = (prof["forward_bytes"][1] - prof["forward_bytes"][0]) / (sizes[1] - sizes[0])
    real = _real_forward_bytes(make(), batch, sizes)
    assert real > 0
    assert abs(predicted - real) / real <= 0.05, (family, predicted, real)


def _gpt_batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, 96, (n, 64)), torch.randint(0, 96, (n, 64))


def _small_gpt() -> nn.Module:
    """The demo GPT with one block: the same shape of plan as four, a quarter of the fake ops
    to run (each plan runs several fake steps)."""
    return GPT(GPTConfig(n_layer=1))


@pytest.mark.parametrize("mode", ["dp", "ddp"])
@pytest.mark.parametrize("devices", ["24GiB,24GiB,12GiB", "24GiB,24GiB-10GiB"])
def test_eta_mem_on_heterogeneous_devices(mode: str, devices: str) -> None:
    p = plan(_small_gpt, _gpt_batch, devices, mode=mode)  # type: ignore[arg-type]
    assert p.eta_mem >= 0.95
    assert p.even_eta_mem < p.eta_mem
    assert all(d.fits for d in p.devices)
    assert p.split == [d.samples for d in p.devices] and sum(p.split) == p.global_batch
    data = json.loads(json.dumps(p.to_dict()))
    assert data["split"] == p.split and len(data["devices"]) == len(p.devices)


def test_plot_leaves_the_global_matplotlib_state_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib

    def no_backend_switch(*args: object, **kwargs: object) -> None:
        raise AssertionError("Plan.plot must not switch the user's matplotlib backend")

    monkeypatch.setattr(matplotlib, "use", no_backend_switch)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)  # importing pyplot now fails
    p = plan(nn.Linear(16, 4), torch.randn(1, 16), "2x64MiB", batch_size=8, cuda_context=0)
    p.plot(str(tmp_path / "plan.png"))
    assert (tmp_path / "plan.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failing_factory_is_a_plan_error() -> None:
    def broken() -> nn.Module:
        raise RuntimeError("no such layer")

    with pytest.raises(PlanError, match="no such layer"):
        plan(broken, torch.randn(2, 4), "8GiB")


def test_batch_that_fits_nowhere() -> None:
    with pytest.raises(PlanError, match="not even one sample"):
        plan(lambda: LMHead(40_000, 250), _lm_batch, "1GiB", criterion=lm_loss)
    with pytest.raises(PlanError, match="largest that fits"):
        plan(nn.Linear(16, 4), torch.randn(1, 16), "2x64MiB", batch_size=10**9, cuda_context=0)


def test_bad_options() -> None:
    with pytest.raises(EvendpError, match="mode"):
        plan(nn.Linear(4, 2), torch.randn(1, 4), "1GiB", mode="fsdp")  # type: ignore[arg-type]
    with pytest.raises(EvendpError, match="safety_margin"):
        plan(nn.Linear(4, 2), torch.randn(1, 4), "1GiB", safety_margin=1.5)


def test_auto_weights_on_cpu_devices_are_equal() -> None:
    assert auto_weights(nn.Linear(4, 2), ["cpu", "cpu"], torch.randn(3, 4)) == [1.0, 1.0]
