"""NVML discovery and device selection, with NVML replaced by a stub (no driver here)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

import evendp._devices as devices_mod
from evendp._devices import (
    DeviceInfo,
    NvmlUnavailableError,
    choose_devices,
    list_devices,
    parse_bytes,
    select_devices,
)
from evendp._errors import EvendpError

GiB = 1 << 30


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError."""


@dataclass
class FakeGpu:
    name: str
    total: int
    free: int
    util: int | None = 0
    pids: list[tuple[int, int | None]] = field(default_factory=list)


class FakeNvml:
    """An object with the pynvml functions evendp calls; ``gpus=None`` means no driver."""

    NVMLError = FakeNVMLError

    def __init__(self, gpus: list[FakeGpu] | None, bytes_strings: bool = False) -> None:
        self.gpus = gpus
        self.bytes_strings = bytes_strings
        self.initialized = 0
        self.shutdowns = 0

    def _s(self, text: str) -> str | bytes:
        return text.encode() if self.bytes_strings else text

    def nvmlInit(self) -> None:
        if self.gpus is None:
            raise FakeNVMLError("NVML Shared Library Not Found")
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        assert self.gpus is not None
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        assert self.gpus is not None
        return self.gpus[index]

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> SimpleNamespace:
        assert self.gpus is not None
        return SimpleNamespace(busId=self._s(f"00000000:{0x10 + self.gpus.index(gpu):02X}:00.0"))

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str | bytes:
        return self._s(gpu.name)

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> SimpleNamespace:
        return SimpleNamespace(total=gpu.total, free=gpu.free, used=gpu.total - gpu.free)

    def nvmlDeviceGetUtilizationRates(self, gpu: FakeGpu) -> SimpleNamespace:
        if gpu.util is None:
            raise FakeNVMLError("Not Supported")
        return SimpleNamespace(gpu=gpu.util, memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, gpu: FakeGpu) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=p, usedGpuMemory=m) for p, m in gpu.pids]


def mixed_gpus(n: int) -> list[FakeGpu]:
    """``n`` GPUs of mixed sizes and loads (deterministic)."""
    kinds = [("NVIDIA H100 80GB HBM3", 80), ("NVIDIA A100-SXM4-40GB", 40), ("Tesla V100", 16)]
    gpus = []
    for i in range(n):
        name, total = kinds[i % 3]
        used = (i * 7) % total
        gpus.append(
            FakeGpu(name, total * GiB, (total - used) * GiB, util=(i * 13) % 100,
                    pids=[(1000 + i, used * GiB)] if used else [])
        )  # fmt: skip
    return gpus


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    stub = FakeNvml(
        [
            FakeGpu("A", 16 * GiB, 2 * GiB, util=90, pids=[(42, 14 * GiB)]),
            FakeGpu("B", 16 * GiB, 15 * GiB),
            FakeGpu("C", 24 * GiB, 9 * GiB, util=None),
            FakeGpu("D", 16 * GiB, 15 * GiB),
        ]
    )
    monkeypatch.setattr(devices_mod, "_load_nvml", lambda: stub)
    monkeypatch.setattr(devices_mod, "_cuda_initialized", lambda: False)
    return stub


def test_list_devices_reads_every_field(fake: FakeNvml) -> None:
    got = list_devices()
    assert [d.index for d in got] == [0, 1, 2, 3]
    assert got[0] == DeviceInfo(
        0, "00000000:10:00.0", "A", 16 * GiB, 2 * GiB, 90, (devices_mod.GpuProcess(42, 14 * GiB),)
    )
    assert got[2].utilization is None
    assert got[0].used_memory == 14 * GiB
    assert fake.initialized == fake.shutdowns == 1  # NVML is shut down again


def test_list_devices_decodes_bytes() -> None:
    got = list_devices(FakeNvml(mixed_gpus(2), bytes_strings=True))
    assert got[0].name == "NVIDIA H100 80GB HBM3"
    assert got[1].pci_bus_id == "00000000:11:00.0"


def test_no_driver_raises_unavailable() -> None:
    with pytest.raises(NvmlUnavailableError, match="no NVIDIA driver"):
        list_devices(FakeNvml(None))


def test_list_devices_does_not_initialize_cuda(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a CPU build CUDA can never initialize; failing any attempt makes the check real.
    monkeypatch.setattr(torch.cuda, "_lazy_init", lambda: pytest.fail("CUDA initialized"))
    list_devices()
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, [1, 3, 2, 0]),  # freest first, ties to the lower id
        ({"count": 2}, [1, 3]),
        ({"ids": [3, 0]}, [3, 0]),  # given order kept
        ({"min_free": "8GiB"}, [1, 3, 2]),
        ({"count": 1, "min_free": 10 * GiB}, [1]),
    ],
)
def test_choose_devices(fake: FakeNvml, kwargs: dict[str, object], expected: list[int]) -> None:
    assert [d.index for d in choose_devices(list_devices(), **kwargs)] == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"count": 5}, "asked for 5 GPU"),
        ({"count": 0}, "positive int"),
        ({"ids": [7]}, "GPU id 7 is not a physical device"),
        ({"ids": [1, 1]}, "repeat"),
        ({"ids": []}, "empty"),
        ({"ids": [0], "count": 1}, "not both"),
        ({"ids": [0], "min_free": "4GiB"}, "GPU 0 has 2.0 GiB free"),
        ({"min_free": "100GiB"}, "found 0"),
        ({"min_free": "lots"}, "cannot read memory size"),
    ],
)
def test_choose_devices_errors(fake: FakeNvml, kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(EvendpError, match=message):
        choose_devices(list_devices(), **kwargs)  # type: ignore[arg-type]


def test_select_devices_sets_environment_and_mapping(fake: FakeNvml) -> None:
    mapping = select_devices(count=2)
    assert mapping == {1: 0, 3: 1}
    assert os.environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,3"


def test_select_devices_the_device_ids_trap(fake: FakeNvml) -> None:
    # Physical GPUs 2 and 3 become cuda:0 and cuda:1; device_ids=[2, 3] would be wrong.
    assert select_devices(gpu_ids=[2, 3]) == {2: 0, 3: 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_select_devices_refuses_after_cuda_init(
    fake: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(devices_mod, "_cuda_initialized", lambda: torch.cuda.is_initialized())
    os.environ["CUDA_VISIBLE_DEVICES"] = "0"
    with pytest.raises(EvendpError, match=r"already initialized.*before any torch.cuda call"):
        select_devices(count=1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"  # left alone


def test_real_cuda_check_is_used_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(EvendpError, match="already initialized"):
        select_devices(gpu_ids=[0])


def test_select_devices_without_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices_mod, "_load_nvml", lambda: FakeNvml(None))
    monkeypatch.setattr(devices_mod, "_cuda_initialized", lambda: False)
    assert select_devices(gpu_ids=[1, 0]) == {1: 0, 0: 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1,0"
    with pytest.raises(EvendpError, match="cannot choose GPUs by count"):
        select_devices(count=1)


@pytest.mark.parametrize(
    ("text", "expected"),
    [("8GiB", 8 * GiB), ("500 MB", 500_000_000), ("1.5g", 1_500_000_000), (7, 7), ("12", 12)],
)
def test_parse_bytes(text: str | int, expected: int) -> None:
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["-1GiB", "8 parsecs", True, -3])
def test_parse_bytes_rejects(bad: object) -> None:
    with pytest.raises(EvendpError):
        parse_bytes(bad)  # type: ignore[arg-type]
