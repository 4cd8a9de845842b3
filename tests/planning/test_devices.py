"""NVML discovery and device selection, with NVML replaced by a stub (no driver here)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

import evendp._planning._devices as devices_mod
from evendp._core._errors import EvendpError
from evendp._planning._devices import (
    DeviceInfo,
    NvmlUnavailableError,
    choose_devices,
    list_devices,
    parse_bytes,
    select_devices,
)

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
    bus: int | None = None  # PCI bus number; default: NVML enumeration position + 0x10


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
        bus = 0x10 + self.gpus.index(gpu) if gpu.bus is None else gpu.bus
        return SimpleNamespace(busId=self._s(f"00000000:{bus:02X}:00.0"))

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str | bytes:
        return self._s(fake_uuid(gpu.name))

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


def fake_uuid(name: str) -> str:
    return f"GPU-{name.encode().hex()}-fake"


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
    monkeypatch.setattr(devices_mod, "load_nvml", lambda: stub)
    monkeypatch.setattr(devices_mod, "_cuda_initialized", lambda: False)
    # A GPU host's real CUDA would see its own GPUs, not the stub's: ask no CUDA here.
    monkeypatch.setattr(devices_mod, "_cuda_device_count", lambda: None)
    return stub


def test_list_devices_reads_every_field(fake: FakeNvml) -> None:
    got = list_devices()
    assert [d.index for d in got] == [0, 1, 2, 3]
    assert got[0] == DeviceInfo(
        0,
        "00000000:10:00.0",
        "A",
        16 * GiB,
        2 * GiB,
        90,
        (devices_mod.GpuProcess(42, 14 * GiB),),
        fake_uuid("A"),
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
        ({"ids": [0], "min_free": "4GiB"}, "GPU 0 has 2.00 GiB free"),
        ({"min_free": "100GiB"}, "with at least 100.00 GiB free, found 0"),
        ({"count": 5, "min_free": "512MiB"}, "with at least 512.0 MiB free"),  # not "0.5 GiB"
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
    assert os.environ["CUDA_VISIBLE_DEVICES"] == f"{fake_uuid('B')},{fake_uuid('D')}"


def test_select_devices_the_device_ids_trap(fake: FakeNvml) -> None:
    # Physical GPUs 2 and 3 become cuda:0 and cuda:1; device_ids=[2, 3] would be wrong.
    assert select_devices(gpu_ids=[2, 3]) == {2: 0, 3: 1}
    assert os.environ["CUDA_VISIBLE_DEVICES"] == f"{fake_uuid('C')},{fake_uuid('D')}"


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
    monkeypatch.setattr(devices_mod, "load_nvml", lambda: FakeNvml(None))
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


# --- what CUDA really sees, schedulers, PCI order -------------------------------------------


_REAL_CUDA_DEVICE_COUNT = devices_mod._cuda_device_count


@pytest.fixture
def cuda_sees(fake: FakeNvml, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A CUDA build whose runtime reports ``cuda_sees[0]`` GPUs (set by the test)."""
    seen = [0]
    monkeypatch.setattr(devices_mod, "_cuda_device_count", _REAL_CUDA_DEVICE_COUNT)
    monkeypatch.setattr(torch.cuda, "_is_compiled", lambda: True)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: seen[0], raising=False)
    return seen


def test_select_devices_refuses_when_cuda_already_fixed_its_gpus(
    fake: FakeNvml, cuda_sees: list[int]
) -> None:
    # torch.cuda.is_available() ran first: the driver kept all 4 GPUs visible, while
    # torch.cuda.is_initialized() is still False. {2: 0, 3: 1} would run on GPUs 0 and 1.
    cuda_sees[0] = 4
    os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    os.environ["CUDA_DEVICE_ORDER"] = "FASTEST_FIRST"
    with pytest.raises(EvendpError, match=r"CUDA sees 4 GPU\(s\), not 2.*restored"):
        select_devices(gpu_ids=[2, 3])
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert os.environ["CUDA_DEVICE_ORDER"] == "FASTEST_FIRST"


def test_select_devices_passes_when_cuda_sees_the_chosen_gpus(
    fake: FakeNvml, cuda_sees: list[int]
) -> None:
    cuda_sees[0] = 2
    assert select_devices(gpu_ids=[2, 3]) == {2: 0, 3: 1}


@pytest.mark.parametrize(
    ("visible", "kwargs", "expected"),
    [
        ("0,2", {}, {2: 0, 0: 1}),  # freest first, within the scheduler's GPUs only
        ("3,0", {"count": 1}, {3: 0}),
        (f"{fake_uuid('C')},{fake_uuid('A')[:12]}", {}, {2: 0, 0: 1}),  # UUIDs, a prefix too
        ("0,2", {"gpu_ids": [0]}, {0: 0}),
    ],
)
def test_select_devices_chooses_within_a_scheduler_set_cuda_visible_devices(
    fake: FakeNvml, visible: str, kwargs: dict[str, object], expected: dict[int, int]
) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    assert select_devices(**kwargs) == expected  # type: ignore[arg-type]
    chosen = {"0": "A", "1": "B", "2": "C", "3": "D"}
    names = [chosen[str(p)] for p in expected]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(fake_uuid(n) for n in names)


@pytest.mark.parametrize(
    ("visible", "kwargs", "message"),
    [
        ("0,2", {"gpu_ids": [1]}, r"GPU 1 is outside CUDA_VISIBLE_DEVICES='0,2'"),
        ("MIG-1234", {}, r"entry 'MIG-1234' names no single GPU"),
        ("7", {}, r"entry '7' names no single GPU"),
    ],
)
def test_select_devices_refuses_what_a_scheduler_set_variable_excludes(
    fake: FakeNvml, visible: str, kwargs: dict[str, object], message: str
) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    with pytest.raises(EvendpError, match=message):
        select_devices(**kwargs)  # type: ignore[arg-type]
    assert os.environ["CUDA_VISIBLE_DEVICES"] == visible


def test_list_devices_numbers_gpus_in_pci_bus_order_not_nvml_order() -> None:
    # NVML enumerates B (bus 0x40) before A (bus 0x20); nvidia-smi and CUDA with
    # CUDA_DEVICE_ORDER=PCI_BUS_ID call A GPU 0.
    gpus = [FakeGpu("B", GiB, GiB, bus=0x40), FakeGpu("A", GiB, GiB, bus=0x20)]
    got = list_devices(FakeNvml(gpus))
    assert [(d.index, d.name) for d in got] == [(0, "A"), (1, "B")]
