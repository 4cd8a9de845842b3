"""GPU discovery through NVML and device selection through ``CUDA_VISIBLE_DEVICES``.

NVML (the library behind ``nvidia-smi``) answers "which GPUs, how much free memory, who uses
them" without creating a CUDA context, so none of this touches CUDA: it is safe to call before
``torch.cuda`` starts, which is exactly when ``CUDA_VISIBLE_DEVICES`` must be set.

Every NVML call goes through the module returned by :func:`load_nvml` and is made inside
:func:`list_devices`; tests substitute a stub object with the same functions there, since
NVML cannot run on a machine with no NVIDIA driver.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._core._errors import EvendpError, NvmlUnavailableError
from .._core._units import format_bytes, parse_bytes
from .._core._validate import is_int, validate_int

__all__ = [
    "load_nvml",
    "DeviceInfo",
    "GpuProcess",
    "NvmlUnavailableError",
    "choose_devices",
    "list_devices",
    "select_devices",
]


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on a GPU (``used_memory`` is ``None`` where NVML hides it)."""

    pid: int
    used_memory: int | None = None


@dataclass(frozen=True)
class DeviceInfo:
    """One physical GPU as NVML reports it; ``index`` is its place in PCI bus order.

    PCI bus order is how ``nvidia-smi`` and CUDA with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` number
    GPUs; NVML's own enumeration order usually matches it but need not. ``uuid`` is NVML's
    ``GPU-...`` identifier ("" where unknown), the one name no ordering changes.

    >>> d = DeviceInfo(0, "00000000:17:00.0", "NVIDIA A100", total_memory=80 << 30,
    ...                free_memory=60 << 30, utilization=35)
    >>> d.used_memory == 20 << 30
    True
    """

    index: int
    pci_bus_id: str
    name: str
    total_memory: int
    free_memory: int
    utilization: int | None = None
    processes: tuple[GpuProcess, ...] = field(default_factory=tuple)
    uuid: str = ""

    @property
    def used_memory(self) -> int:
        """Bytes in use (by anyone) on this device."""
        return self.total_memory - self.free_memory


def load_nvml() -> Any:
    """The NVML binding; the single place tests replace with a stub module."""
    import pynvml

    return pynvml


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py returns bytes for names and bus ids, newer returns str.
    return value.decode() if isinstance(value, bytes) else value


def list_devices(nvml: Any = None) -> list[DeviceInfo]:
    """Every GPU NVML sees, in PCI bus order (``index`` counts in it); creates no CUDA context.

    ``nvml`` defaults to the ``pynvml`` module; pass an object with the same functions to
    substitute it. Raises :class:`NvmlUnavailableError` when there is no NVIDIA driver.

    >>> try:
    ...     devices = list_devices()
    ... except NvmlUnavailableError:
    ...     devices = []
    >>> isinstance(devices, list)
    True
    """
    nvml = load_nvml() if nvml is None else nvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        raise NvmlUnavailableError(f"NVML could not start ({exc}); no NVIDIA driver?") from exc

    def optional(read: Any, handle: Any, default: Any) -> Any:
        try:
            return read(handle)
        except nvml.NVMLError:
            return default

    try:
        devices = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            # Not supported on some boards and in MIG mode:
            rates = optional(nvml.nvmlDeviceGetUtilizationRates, handle, None)
            # Containers often may not list other processes:
            running = optional(nvml.nvmlDeviceGetComputeRunningProcesses, handle, [])
            processes = tuple(
                GpuProcess(int(p.pid), getattr(p, "usedGpuMemory", None)) for p in running
            )
            devices.append(
                DeviceInfo(
                    index=index,
                    pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(handle).busId),
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    total_memory=int(memory.total),
                    free_memory=int(memory.free),
                    utilization=None if rates is None else int(rates.gpu),
                    processes=processes,
                    uuid=_text(optional(nvml.nvmlDeviceGetUUID, handle, "")),
                )
            )
        # Bus ids are fixed-width hex ("00000000:17:00.0"): sorting the text sorts the buses.
        devices.sort(key=lambda d: d.pci_bus_id.lower())
        return [dataclasses.replace(d, index=i) for i, d in enumerate(devices)]
    finally:
        nvml.nvmlShutdown()


def _validate_id_list(ids: object) -> None:
    if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
        raise EvendpError(f"gpu_ids must be a list of physical GPU ids, got {ids!r}; e.g. [2, 3]")


def _validate_selection(
    devices: Sequence[DeviceInfo],
    count: int | None,
    ids: Sequence[int] | None,
) -> None:
    """Raise :class:`EvendpError` naming a bad ``count`` or ``ids`` and the fix."""
    if count is not None and ids is not None:
        raise EvendpError(
            f"pass either count ({count!r}) or gpu_ids ({list(ids)!r}), not both; "
            "gpu_ids already fixes how many devices are used"
        )
    validate_int("count", count, minimum=1, allow_none=True, example="count=2")
    if ids is not None:
        _validate_id_list(ids)
        ids = list(ids)
        if not ids:
            raise EvendpError(
                "gpu_ids is empty; pass physical GPU ids such as [2, 3], or use count"
            )
        known = {d.index for d in devices}
        for i in ids:
            if not is_int(i) or i not in known:
                raise EvendpError(
                    f"GPU id {i!r} is not a physical device; this machine has ids "
                    f"{sorted(known)} (see `evendp devices`)"
                )
        if len(set(ids)) != len(ids):
            raise EvendpError(f"gpu_ids {ids!r} repeat a GPU; list each physical id once")


def choose_devices(
    devices: Sequence[DeviceInfo],
    count: int | None = None,
    ids: Sequence[int] | None = None,
    min_free: int | float | str | None = None,
) -> list[DeviceInfo]:
    """Pick devices: the given physical ``ids`` in that order, else the freest first.

    Pure: reads ``devices`` (from :func:`list_devices`) and touches no environment.
    ``min_free`` (bytes or e.g. ``"8GiB"``) drops devices with less free memory.

    >>> gpus = [DeviceInfo(0, "0:1", "A", 16 << 30, 2 << 30),
    ...         DeviceInfo(1, "0:2", "A", 16 << 30, 15 << 30),
    ...         DeviceInfo(2, "0:3", "A", 16 << 30, 9 << 30)]
    >>> [d.index for d in choose_devices(gpus, count=2)]
    [1, 2]
    >>> [d.index for d in choose_devices(gpus, ids=[2, 0])]
    [2, 0]
    >>> [d.index for d in choose_devices(gpus, min_free="8GiB")]
    [1, 2]
    """
    _validate_selection(devices, count, ids)
    floor = 0 if min_free is None else parse_bytes(min_free)
    if ids is not None:
        by_index = {d.index: d for d in devices}
        chosen = [by_index[i] for i in ids]
        short = [d for d in chosen if d.free_memory < floor]
        if short:
            raise EvendpError(
                f"GPU {short[0].index} has {format_bytes(short[0].free_memory)} free, under "
                f"min_free={min_free!r}; pick other ids or lower min_free"
            )
        return chosen
    # Freest first, ties to the lower id: the freest card becomes logical device 0, which
    # is the one that also holds gathered outputs and the loss in single-process runs.
    ranked = sorted(
        (d for d in devices if d.free_memory >= floor), key=lambda d: (-d.free_memory, d.index)
    )
    wanted = len(ranked) if count is None else count
    if len(ranked) < wanted or not ranked:
        have = ", ".join(f"{d.index}: {format_bytes(d.free_memory)}" for d in devices) or "none"
        raise EvendpError(
            f"asked for {wanted if count is not None else 'at least 1'} GPU(s) with at least "
            f"{format_bytes(floor)} free, found {len(ranked)} (free memory by id: {have}); "
            "lower count or min_free, or free memory on the busy devices"
        )
    return ranked[:wanted]


def _cuda_initialized() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def _cuda_device_count() -> int | None:
    """How many GPUs CUDA itself sees now (``None`` for a torch built without CUDA).

    Asks the CUDA runtime, not ``torch.cuda.device_count()`` (which answers from NVML and
    ``CUDA_VISIBLE_DEVICES`` before CUDA starts): once anything started the driver, e.g.
    ``torch.cuda.is_available()``, the runtime keeps the GPUs that were visible then, while
    ``torch.cuda.is_initialized()`` still says False.
    """
    import torch

    if not torch.cuda._is_compiled():
        return None
    return int(torch._C._cuda_getDeviceCount())


_ORDER, _VISIBLE = "CUDA_DEVICE_ORDER", "CUDA_VISIBLE_DEVICES"


def _allowed(devices: list[DeviceInfo], visible: str | None) -> list[DeviceInfo]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` set before the call (a scheduler's) allows.

    Entries are physical ids (in PCI bus order, as schedulers number GPUs) or ``GPU-`` UUIDs
    (or a unique prefix of one, as CUDA accepts).
    """
    if visible is None:
        return devices
    allowed: list[DeviceInfo] = []
    for entry in (e.strip() for e in visible.split(",") if e.strip()):
        if entry.isdigit():
            match = [d for d in devices if d.index == int(entry)]
        elif entry.startswith("GPU-"):
            match = [d for d in devices if d.uuid and d.uuid.startswith(entry)]
        else:
            match = []
        if len(match) != 1:
            raise EvendpError(
                f"CUDA_VISIBLE_DEVICES={visible!r} was set before select_devices (by a "
                f"scheduler?) and its entry {entry!r} names no single GPU of this machine; "
                "select_devices chooses within it, so it must list physical ids or GPU UUIDs "
                "(see `evendp devices`), or unset it"
            )
        allowed.append(match[0])
    return allowed


def select_devices(
    count: int | None = None,
    gpu_ids: Sequence[int] | None = None,
    min_free: int | float | str | None = None,
    *,
    nvml: Any = None,
) -> dict[int, int]:
    """Make the chosen GPUs the only visible ones; returns ``{physical id: logical id}``.

    Chooses the freest ``count`` GPUs (all, when ``None``) with at least ``min_free`` free, or
    exactly the physical ``gpu_ids`` in the given order, then sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    (so CUDA numbers GPUs like ``nvidia-smi`` does) and ``CUDA_VISIBLE_DEVICES``. After the
    call, physical GPU ``p`` is ``cuda:{mapping[p]}``: use the logical ids in
    ``device_ids``. GPUs are named by UUID in ``CUDA_VISIBLE_DEVICES`` where NVML gives one
    (no ordering can then mix them up). Must run before CUDA starts: after setting the
    variables it asks CUDA how many GPUs it sees, and on a mismatch (something, e.g.
    ``torch.cuda.is_available()``, started CUDA earlier) restores them and raises
    :class:`EvendpError`. A ``CUDA_VISIBLE_DEVICES`` set before the call (by a scheduler) is
    kept as the limit: the choice is made among the GPUs it lists.

    With no NVIDIA driver, ``gpu_ids`` are taken as given (nothing to check them against) and
    ``count``/``min_free`` raise :class:`EvendpError`.

    >>> import os
    >>> old = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    >>> import torch
    >>> import warnings
    >>> if not torch.cuda.is_initialized():
    ...     try:
    ...         with warnings.catch_warnings():  # no driver: "cannot be checked"
    ...             warnings.simplefilter("ignore", UserWarning)
    ...             mapping = select_devices(gpu_ids=[0])
    ...     except EvendpError:  # a driver is present but GPU 0 does not exist
    ...         mapping = {0: 0}
    ...     print(mapping)
    ... else:
    ...     print({0: 0})
    {0: 0}
    >>> for k, v in old.items():
    ...     _ = os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    """
    if gpu_ids is not None:
        _validate_id_list(gpu_ids)
    if _cuda_initialized():
        raise EvendpError(
            "CUDA is already initialized in this process, so CUDA_VISIBLE_DEVICES can no "
            "longer change which GPUs it sees; call evendp.select_devices(...) at the very top "
            "of the script, before any torch.cuda call or .cuda()/.to('cuda'), or set it in "
            "the shell: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=2,3 python train.py"
        )
    saved = {key: os.environ.get(key) for key in (_ORDER, _VISIBLE)}
    try:
        devices = list_devices(nvml)
    except NvmlUnavailableError as exc:
        if gpu_ids is None or count is not None or min_free is not None:
            raise EvendpError(
                f"cannot choose GPUs by count or free memory: {exc}; pass gpu_ids=[...] "
                "explicitly, or run on CPU"
            ) from exc
        physical = list(gpu_ids)
        _validate_selection([DeviceInfo(i, "", "", 0, 0) for i in physical], None, physical)
        warnings.warn(
            f"select_devices(gpu_ids={physical}): no NVIDIA driver found ({exc}), so these "
            "GPUs cannot be checked; CUDA_VISIBLE_DEVICES is set as given, and with no GPU "
            "torch will run on the CPU",
            stacklevel=2,
        )
        names = [str(p) for p in physical]
        driver = False
    else:
        driver = True
        allowed = _allowed(devices, saved[_VISIBLE])
        hidden = {d.index for d in devices} - {d.index for d in allowed}
        outside = [i for i in gpu_ids or [] if i in hidden]
        if outside:
            raise EvendpError(
                f"GPU {outside[0]} is outside CUDA_VISIBLE_DEVICES={saved[_VISIBLE]!r}, set "
                f"before the call (by a scheduler?); choose among physical ids "
                f"{[d.index for d in allowed]}"
            )
        chosen = choose_devices(allowed, count, gpu_ids, min_free)
        physical = [d.index for d in chosen]
        # UUIDs name the same GPUs whatever order CUDA numbers them in.
        names = [d.uuid or str(d.index) for d in chosen]
    os.environ[_ORDER] = "PCI_BUS_ID"
    os.environ[_VISIBLE] = ",".join(names)
    # Without a driver there is nothing CUDA could see; with one, check what it really sees.
    seen = _cuda_device_count() if driver else None
    if seen is not None and seen != len(physical):
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        raise EvendpError(
            f"after setting CUDA_VISIBLE_DEVICES to GPUs {physical}, CUDA sees {seen} GPU(s), "
            f"not {len(physical)}: CUDA already started in this process (torch.cuda."
            "is_available() or device_count() starts it, while torch.cuda.is_initialized() "
            "stays False), so the variable no longer changes which GPUs it uses; the "
            "variables are restored. Call evendp.select_devices(...) before any torch.cuda "
            "call, or set them in the shell: CUDA_DEVICE_ORDER=PCI_BUS_ID "
            "CUDA_VISIBLE_DEVICES=2,3 python train.py"
        )
    return {p: logical for logical, p in enumerate(physical)}
