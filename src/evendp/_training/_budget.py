"""Virtual devices with a memory budget they enforce: CPU stand-ins for small GPUs.

``BalancedDataParallel`` runs each replica's forward in its own thread; :class:`MemoryBudgets`
puts a dispatch mode there that counts every tensor storage the forward creates, from the op
that allocates it until its last tensor dies (saved activations stay counted until backward
frees them), plus the bytes the device holds anyway (``resident``: the parameters; on the home
device also the gradients and optimizer state). A total past the budget raises
``torch.OutOfMemoryError`` in that replica, as a full GPU would. Not counted: the backward
(the autograd engine's thread), the gathered outputs and loss, allocator overheads. The
recorded peak is the *forward* peak, below the planner's forward+backward peak.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._core._errors import EvendpError
from .._core._units import format_bytes, parse_bytes

__all__ = ["MemoryBudgets", "ReplicaMemory", "tensor_bytes"]


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the distinct storages under ``tensors`` (any nesting; ``None`` entries skipped).

    >>> w = torch.zeros(4, 4)
    >>> tensor_bytes([w, w[0], torch.zeros(2, dtype=torch.float64)])
    80
    """
    seen: dict[int, int] = {}
    for t in tree_leaves(tensors):
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr() or id(st)] = st.nbytes()
    return sum(seen.values())


class ReplicaMemory(TorchDispatchMode):
    """Live bytes of the storages created under this mode in this thread (dispatch modes are
    thread-local) plus ``resident``, checked against ``budget`` (``None``: only measured).

    >>> with ReplicaMemory("cpu:2", budget=1000, resident=0) as mem:
    ...     a = torch.zeros(100)  # 400 bytes
    ...     b = torch.zeros(100)
    ...     del a
    ...     c = torch.zeros(100)
    >>> mem.live, mem.peak
    (800, 800)
    >>> with ReplicaMemory("cpu:2", budget=1000, resident=0):  # doctest: +ELLIPSIS
    ...     x = torch.zeros(300)
    Traceback (most recent call last):
    ...
    torch.OutOfMemoryError: virtual device cpu:2 is out of its 1000 B budget: ...
    """

    def __init__(self, name: str, budget: int | None, resident: int) -> None:
        super().__init__()
        self.name = name
        self.budget = budget
        self.resident = resident
        self.created = 0  # bytes of this mode's storages still alive
        self.peak = resident
        self._alive: dict[int, weakref.ref[Any]] = {}
        self._lock = threading.Lock()  # finalizers may run in another thread (backward)

    @property
    def live(self) -> int:
        """Resident bytes plus the bytes of this mode's storages still alive."""
        return self.resident + self.created

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            st = t.untyped_storage()
            key = id(st)
            if key in inputs or key in self._alive:
                continue  # a view, an in-place result or a storage counted already
            self._track(key, st)
        if self.budget is not None and self.live > self.budget:
            raise torch.OutOfMemoryError(
                f"virtual device {self.name} is out of its {format_bytes(self.budget)} budget: "
                f"{format_bytes(self.live)} live after {func} ({format_bytes(self.resident)} "
                f"resident + {format_bytes(self.created)} allocated by this replica's forward)"
            )
        return out

    def _track(self, key: int, storage: Any) -> None:
        nbytes = int(storage.nbytes())

        def release(_: Any, key: int = key, nbytes: int = nbytes) -> None:
            with self._lock:
                if self._alive.pop(key, None) is not None:
                    self.created -= nbytes

        with self._lock:
            self._alive[key] = weakref.ref(storage, release)
            self.created += nbytes
            self.peak = max(self.peak, self.live)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


Resident = Callable[[int], int] | Sequence[int] | None


class MemoryBudgets:
    """Per-device memory budgets (ints or sizes such as ``"24MiB"``) for a
    :class:`~evendp.BalancedDataParallel`, enforced in every replica's forward once
    ``attach(dp)``-ed. ``resident``: the bytes each device holds outside the forward, a list or
    a function of the device index called at every forward (it sees optimizer state appear);
    ``names``: the devices' in messages (``vdev:i``). ``peaks``: each device's largest forward
    total since the last ``reset_peaks()`` (``None``: it ran nothing).

    >>> from evendp import BalancedDataParallel
    >>> net = torch.nn.Linear(64, 64)
    >>> dp = BalancedDataParallel(net, ["cpu"] * 2, weights=[3, 1])
    >>> budgets = MemoryBudgets(["1MiB", "6KiB"]).attach(dp)
    >>> _ = dp(torch.randn(64, 64))  # 48 / 16 rows: 16 rows of output (4 KiB) fit in 6 KiB
    >>> dp.weights = None            # an even split: 32 rows of 64 floats do not
    >>> dp(torch.randn(64, 64))      # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    torch.OutOfMemoryError: virtual device vdev:1 is out of its 6.0 KiB budget: ...
    """

    def __init__(
        self, budgets: Sequence[int | str], resident: Resident = None, names: Any = None
    ) -> None:
        if isinstance(budgets, (str, bytes)) or not budgets:
            raise EvendpError(
                f"budgets must be a list of sizes, one per device, got {budgets!r}; "
                "e.g. ['48MiB', '48MiB', '24MiB']"
            )
        self.budgets = [parse_bytes(b) for b in budgets]
        if isinstance(resident, Sequence) and len(resident) != len(self.budgets):
            raise EvendpError(
                f"resident has {len(resident)} entries for {len(self.budgets)} budgets; "
                "give one per device"
            )
        self.resident = resident
        count = len(self.budgets)
        self.names = list(names) if names is not None else [f"vdev:{i}" for i in range(count)]
        self.peaks: list[int | None] = [None] * len(self.budgets)
        self.ooms = [0] * len(self.budgets)

    def attach(self, dp: Any) -> MemoryBudgets:
        """Make ``dp`` (a BalancedDataParallel) enforce these budgets; returns ``self``."""
        if len(dp.device_ids) != len(self.budgets):
            raise EvendpError(
                f"{len(self.budgets)} budgets for {len(dp.device_ids)} devices; give one each"
            )
        dp.set_replica_context(self.replica)
        return self

    @contextlib.contextmanager
    def replica(self, index: int) -> Iterator[ReplicaMemory]:
        """The budget of device ``index``, active in the calling thread for one forward."""
        held = self.resident  # outside the forward: read now (optimizer state appears)
        resident = 0 if held is None else int(held(index) if callable(held) else held[index])
        mode = ReplicaMemory(self.names[index], self.budgets[index], resident)
        try:
            with mode:
                yield mode
        except torch.OutOfMemoryError:
            self.ooms[index] += 1
            raise
        finally:
            old = self.peaks[index]
            self.peaks[index] = mode.peak if old is None else max(old, mode.peak)

    def reset_peaks(self) -> None:
        """Forget the recorded peaks (e.g. after a warm-up or a probe)."""
        self.peaks = [None] * len(self.budgets)
