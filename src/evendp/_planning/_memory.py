"""How much memory each device offers a job: declared (``"24GiB,24GiB-10GiB"``) or read live.

The planner (:mod:`evendp._planning._planner`) only needs one number per device: the bytes
this job may use. A declared spec lets a laptop with no GPU plan for any machine; the live
reading uses NVML, which creates no CUDA context, and falls back to ``torch.cuda.mem_get_info``
only where NVML cannot say which physical GPU a CUDA index is.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .._core._errors import EvendpError, LiveMemoryError
from .._core._units import parse_bytes
from .._core._validate import shown, validate_sequence
from ._devices import NvmlUnavailableError, list_devices

__all__ = [
    "DEFAULT_CONTEXT",
    "MAX_DEVICES",
    "DeviceMemory",
    "LiveMemoryError",
    "live_memory",
    "memory_runs",
    "parse_memory",
]

#: The allowance per device for the CUDA context, typical on recent GPUs (``plan(cuda_context=)``,
#: ``--context``; CPU devices are charged none). cuBLAS/cuDNN workspaces are modelled apart,
#: with the caching allocator (:mod:`._allocator`).
DEFAULT_CONTEXT = 512 << 20

#: The most devices a spec may declare in all (``Nx`` repeats summed): the planner handles a
#: million alike devices as one entry, but ``1000000000x24GiB`` would be built device by device
#: by :func:`parse_memory` (minutes, then MemoryError), so it is refused before any work.
MAX_DEVICES = 1_000_000

_SPEC_HELP = (
    "write one entry per device, separated by commas: a size ('24GiB', '12GB', bytes), "
    "optionally minus what another job already uses ('24GiB-10GiB'), optionally repeated "
    "('2x24GiB'); e.g. '24GiB,24GiB-10GiB,12GiB'"
)


@dataclass(frozen=True)
class DeviceMemory:
    """One device as the planner sees it: a name and the bytes this job may use.

    ``total`` is the device's size when known (declared ``24GiB-10GiB`` or read live).

    >>> d = DeviceMemory("cuda:1", free=14 << 30, total=24 << 30)
    >>> d.used == 10 << 30
    True
    """

    name: str
    free: int
    total: int | None = None

    @property
    def used(self) -> int | None:
        """Bytes already taken by others, when the total is known."""
        return None if self.total is None else self.total - self.free


def _parse_entry(entry: str, spec: str) -> tuple[int, int, int | None]:
    """``"[Nx]SIZE[-USED]"`` -> (count, free bytes, total bytes or None)."""
    # An entry is a few words: a long one is a typo (and the regex would take quadratic time).
    pattern = r"\s*(?:(\d{1,18})\s*[xX*]\s*)?([^-]+?)\s*(?:-\s*(.+?))?\s*"
    match = None if len(entry) > 100 else re.fullmatch(pattern, entry)
    unreadable = f"cannot read device entry {shown(entry)} in {shown(spec)}; {_SPEC_HELP}"
    if match is None or not match.group(2):
        raise EvendpError(unreadable)
    count = 1 if match.group(1) is None else int(match.group(1))
    if not 1 <= count <= MAX_DEVICES:
        raise EvendpError(
            f"device entry {shown(entry)} repeats a device {count} times; use N in "
            f"[1, {MAX_DEVICES}], e.g. 8x24GiB"
        )
    try:
        size = parse_bytes(match.group(2))
        used = 0 if match.group(3) is None else parse_bytes(match.group(3))
    except EvendpError as exc:
        raise EvendpError(unreadable) from exc
    if used > size:
        raise EvendpError(
            f"device entry {shown(entry)} uses more ({used} bytes) than the device has ({size} "
            "bytes); write TOTAL-USED with USED <= TOTAL"
        )
    total = None if match.group(3) is None else size
    return count, size - used, total


def parse_memory(spec: str | Sequence[int | str]) -> list[DeviceMemory]:
    """Devices from a declared spec: ``"24GiB,24GiB-10GiB,2x12GiB"`` or a list of sizes.

    Each entry is one device's memory: a size with a unit (``GiB``/``MiB`` are powers of
    1024, ``GB``/``MB`` powers of 1000, a bare number is bytes), optionally ``-USED`` for
    memory another job already holds, optionally prefixed ``Nx`` for N equal devices.
    Devices are named ``dev0``, ``dev1``... in order; ``dev0`` is the DP output device.

    >>> [d.free >> 30 for d in parse_memory("24GiB,24GiB-10GiB,2x12GiB")]
    [24, 14, 12, 12]
    >>> parse_memory([1000, "1KiB"])[1]
    DeviceMemory(name='dev1', free=1024, total=None)
    >>> parse_memory("24 furlongs")
    Traceback (most recent call last):
    ...
    evendp.InputError: cannot read device entry '24 furlongs' in '24 furlongs'; ...
    """
    one_each = [(free, total) for count, free, total in memory_runs(spec) for _ in range(count)]
    return [DeviceMemory(f"dev{i}", free, total) for i, (free, total) in enumerate(one_each)]


def memory_runs(spec: str | Sequence[int | str]) -> list[tuple[int, int, int | None]]:
    """The entries of a spec as ``(count, free, total)``, one per entry, in order: what
    :func:`parse_memory` repeats into devices. The planner works on these (``"1000000x1GiB"``
    is one entry, not a million devices).

    >>> memory_runs("2x24GiB,12GiB-2GiB") == [(2, 24 << 30, None), (1, 10 << 30, 12 << 30)]
    True
    """
    if isinstance(spec, str):
        entries: list[str] = [e for e in spec.split(",")]
        text = spec
    elif isinstance(spec, Sequence):
        entries = [str(e) for e in spec]
        text = repr(list(spec))
    else:
        raise EvendpError(
            f"memory must be a string like '24GiB,12GiB' or a list, got {shown(spec)}"
        )
    if len(entries) > MAX_DEVICES:
        raise EvendpError(
            f"device spec {shown(text)} has {len(entries)} entries, more than the {MAX_DEVICES} "
            "devices evendp plans for; write alike devices once with a count, e.g. 8x24GiB"
        )
    if not entries or any(not e.strip() for e in entries):
        raise EvendpError(f"device spec {shown(text)} has an empty entry; {_SPEC_HELP}")
    runs, total = [], 0
    for entry in entries:
        runs.append(_parse_entry(entry, text))
        total += runs[-1][0]
        if total > MAX_DEVICES:  # before anything is built for them
            raise EvendpError(
                f"device spec {shown(text)} declares {total}+ devices, more than the "
                f"{MAX_DEVICES} evendp plans for; declare the devices one job uses, e.g. "
                "8x24GiB"
            )
    return runs


def _visible_physical_ids() -> list[int] | Literal["all"] | None:
    """Physical (NVML) ids of the CUDA devices this process sees.

    ``"all"`` when every GPU is visible in NVML (PCI bus) order, a list (``[]`` for
    ``CUDA_VISIBLE_DEVICES=""``: none visible) when the mapping is known, ``None`` when it is
    unknowable.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    pci_order = os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    if visible is None:
        return "all" if pci_order else None
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if not pci_order or not all(v.isdigit() for v in ids):
        return None  # UUIDs, or CUDA's fastest-first order: NVML cannot map them
    return [int(v) for v in ids]


def live_memory(device_ids: Sequence[int] | None = None, *, nvml: Any = None) -> list[DeviceMemory]:
    """Free memory of CUDA devices ``device_ids`` (default: all visible), read now.

    Uses NVML (no CUDA context) when the CUDA index -> physical GPU mapping is known
    (``CUDA_DEVICE_ORDER=PCI_BUS_ID``, as :func:`evendp.select_devices` sets, or one GPU);
    otherwise, or once CUDA is already running, ``torch.cuda.mem_get_info``. Raises
    :class:`EvendpError` on a machine with no GPU: declare the devices with
    :func:`parse_memory` there.

    >>> import torch
    >>> if not torch.cuda.is_available():
    ...     try:
    ...         live_memory()
    ...     except EvendpError as exc:
    ...         print("no GPU")
    ... else:
    ...     print("no GPU")  # keep the doctest quiet where one is present
    no GPU
    """
    if device_ids is not None:
        validate_sequence("device_ids", device_ids, integral=True, example="device_ids=[0, 1]")
    # --- GPU-only path below: nothing here runs on a machine without a driver. ---
    import torch

    if not torch.cuda.is_initialized():
        try:
            gpus = list_devices(nvml)
        except (NvmlUnavailableError, ImportError):
            gpus = []
        mapping = _visible_physical_ids()
        if mapping == []:
            raise LiveMemoryError(
                "CUDA_VISIBLE_DEVICES is empty, so this process sees no GPU; unset it or list "
                "the GPUs to use (e.g. CUDA_VISIBLE_DEVICES=0,1)"
            )
        if gpus and (mapping is not None or len(gpus) == 1):
            physical = mapping if isinstance(mapping, list) else [g.index for g in gpus]
            by_index = {g.index: g for g in gpus}
            wanted = range(len(physical)) if device_ids is None else device_ids
            out = []
            for i in wanted:
                if not 0 <= i < len(physical) or physical[i] not in by_index:
                    raise EvendpError(
                        f"CUDA device {i} does not exist; visible devices are "
                        f"0..{len(physical) - 1} (see `evendp devices`)"
                    )
                g = by_index[physical[i]]
                out.append(DeviceMemory(f"cuda:{i}", g.free_memory, g.total_memory))
            return out
    if not torch.cuda.is_available():
        raise LiveMemoryError("no CUDA device to read free memory from")
    count = torch.cuda.device_count()
    wanted = range(count) if device_ids is None else device_ids
    out = []
    for i in wanted:
        if not 0 <= i < count:
            raise EvendpError(f"CUDA device {i} does not exist; this process sees 0..{count - 1}")
        free, total = torch.cuda.mem_get_info(i)
        out.append(DeviceMemory(f"cuda:{i}", int(free), int(total)))
    return out
