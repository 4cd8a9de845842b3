"""Count the host's reads of tensor values during a block (issue 26: no host sync per step).

On a GPU, every read of a tensor's value by Python (``loss.item()``, ``float(norm)``,
``if flag:``, ``t.tolist()``) waits for the device to finish the work queued so far, so the
CPU cannot run ahead. On the CPU machines the tests run on nothing waits, but the same calls
happen; this counter sees them there:

- a :class:`torch.overrides.TorchFunctionMode` sees every read that goes through torch's
  function dispatch (on torch 2.13: ``item``, ``tolist``, ``__bool__``, ``__float__``,
  ``__int__``, ``__index__``, ``__complex__``, ``__format__``, ``__repr__``, ``numpy``,
  ``__array__``, ``torch.equal``, ``torch.is_nonzero``, ``torch.allclose``, checked by
  tests/test_host_reads_counter.py), and the ops whose output's size depends on the values
  (``nonzero``, ``masked_select``, ``unique``, a boolean-mask index, ``repeat_interleave``
  without ``output_size``), which wait for the device on a GPU as well;
- the same methods patched on ``torch.Tensor`` (and the three functions on ``torch``) catch
  the reads the mode misses: those made while the mode is off, inside another torch
  function's handler or under ``torch._C.DisableTorchFunction``. Both sides share one
  depth counter, so a read seen by both is counted once. The patches are undone on exit.

Only the thread that opened the block is counted (the mode is per thread): that is the
thread running the step, the one a sync would hold back. ``.cpu()``/``.to("cpu")`` count
only for a tensor not already on the CPU.

Each read records its kind, the innermost frame outside torch (``site``: who asked) and the
innermost frame inside the ``evendp`` package (``culprit``), so a failing count names the
function to change.

    >>> import torch
    >>> with HostReads() as reads:
    ...     t = torch.ones(3)
    ...     s = (t * 2).sum()
    ...     v = float(s)
    >>> [r.kind for r in reads.reads]
    ['__float__']
"""

from __future__ import annotations

import functools
import sys
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import evendp

__all__ = ["HostRead", "HostReads", "culprits", "optimizer_steps"]

#: Tensor methods (and ``torch`` functions) whose result is a value read on the host.
READ_METHODS = (
    "item",
    "tolist",
    "__bool__",
    "__float__",
    "__int__",
    "__index__",
    "__complex__",
    "__format__",
    "__repr__",
    "numpy",
    "__array__",
)
READ_FUNCTIONS = ("equal", "is_nonzero", "allclose")
#: Ops whose output's size depends on the values: on a GPU they wait for the device too.
SIZE_FROM_VALUES = ("nonzero", "argwhere", "masked_select", "unique", "unique_consecutive")

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_EVENDP_DIR = str(Path(evendp.__file__).resolve().parent)
_THIS_FILE = str(Path(__file__).resolve())


@dataclass(frozen=True)
class HostRead:
    """One read: what (``kind``), who asked (``site``), evendp's frame (``culprit``), when."""

    kind: str
    site: str
    culprit: str | None
    key: Any = None

    @property
    def by_evendp(self) -> bool:
        """Whether evendp itself asked (not the model or torch called by the model)."""
        return self.site.startswith("evendp/")


class _Depth(threading.local):
    depth = 0


_depth = _Depth()


def _name(func: Any) -> str:
    return str(getattr(func, "__name__", func))


def _is_cpu_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    targets = [*args[1:], kwargs.get("device")]
    return any(str(t) == "cpu" or getattr(t, "type", None) == "cpu" for t in targets)


def _read_kind(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The kind of host read ``func(*args, **kwargs)`` is, or ``None`` for a tensor op."""
    name = _name(func)
    if name in READ_METHODS or name in READ_FUNCTIONS or name in SIZE_FROM_VALUES:
        return name
    first = args[0] if args else None
    if not isinstance(first, torch.Tensor):
        return None
    if name in ("cpu", "to") and first.device.type != "cpu":
        return name if name == "cpu" or _is_cpu_target(args, kwargs) else None
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
            return f"{name}[bool mask]"
    repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
    unsized = name == "repeat_interleave" and kwargs.get("output_size") is None
    if unsized and isinstance(repeats, torch.Tensor) and repeats.numel() > 1:
        return "repeat_interleave"
    return None


@functools.lru_cache(maxsize=4096)
def _resolved(filename: str) -> str:
    return str(Path(filename).resolve())


def _where(frame: FrameType) -> str:
    path = _resolved(frame.f_code.co_filename)
    if path.startswith(_EVENDP_DIR):
        path = "evendp" + path[len(_EVENDP_DIR) :]
    return f"{path}:{frame.f_code.co_name}:{frame.f_lineno}"


def _frames() -> tuple[str, str | None]:
    """(the innermost frame outside torch and this file, the innermost frame in evendp)."""
    site: str | None = None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        path = _resolved(frame.f_code.co_filename)
        if site is None and not path.startswith(_TORCH_DIR) and path != _THIS_FILE:
            site = _where(frame)
        if path.startswith(_EVENDP_DIR):
            return site or _where(frame), _where(frame)
        frame = frame.f_back
    return site or "?", None


class _Mode(TorchFunctionMode):
    def __init__(self, counter: HostReads) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        kind = _read_kind(func, args, kwargs)
        if kind is None:
            return func(*args, **kwargs)
        tensor = args[0] if args else None
        return self.counter._counted(kind, tensor, lambda: func(*args, **kwargs))


class HostReads:
    """Context manager counting the host's reads of tensor values (see the module's text).

    ``key``: called at each read, its value stored with the read (e.g. the Trainer's step),
    so reads can be grouped by when they happened. ``ignore(tensor)``: true for a tensor
    that lives on the host in a GPU run too (reading it waits for nothing), such as the
    optimizer's step counts (:func:`optimizer_steps`).
    """

    def __init__(
        self,
        key: Callable[[], Any] | None = None,
        ignore: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        self.key = key
        self.ignore = ignore
        self.reads: list[HostRead] = []
        self._thread = threading.get_ident()
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode = _Mode(self)
        self._on = False

    # -- counting ----------------------------------------------------------------------------

    def _counted(self, kind: str, tensor: Any, call: Callable[[], Any]) -> Any:
        """Run the read ``call`` of ``tensor``; record it unless an outer read is already
        being counted, it happens on another thread, or ``ignore`` says it is a host tensor."""
        if (
            self._on
            and _depth.depth == 0
            and threading.get_ident() == self._thread
            and not (self.ignore is not None and self._ignored(tensor))
        ):
            site, culprit = _frames()
            key = self.key() if self.key is not None else None
            self.reads.append(HostRead(kind, site, culprit, key))
        _depth.depth += 1
        try:
            return call()
        finally:
            _depth.depth -= 1

    def _ignored(self, tensor: Any) -> bool:
        assert self.ignore is not None
        return isinstance(tensor, torch.Tensor) and self.ignore(tensor)

    def _patch(self, owner: Any, name: str) -> None:
        original = getattr(owner, name)
        had = name in vars(owner)
        counter = self

        def patched(*args: Any, **kwargs: Any) -> Any:
            tensor = args[0] if args else None
            return counter._counted(name, tensor, lambda: original(*args, **kwargs))

        self._saved.append((owner, name, original if had else None))
        setattr(owner, name, patched)

    def __enter__(self) -> HostReads:
        self._thread = threading.get_ident()
        for name in READ_METHODS:
            self._patch(torch.Tensor, name)
        for name in READ_FUNCTIONS:
            self._patch(torch, name)
        self._mode.__enter__()
        self._on = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._on = False
        try:
            self._mode.__exit__(None, None, None)
        finally:
            for owner, name, original in reversed(self._saved):
                if original is None:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            self._saved.clear()

    # -- reading the result ------------------------------------------------------------------

    def where(self, key: Any) -> list[HostRead]:
        """The reads recorded while ``key()`` returned ``key``."""
        return [r for r in self.reads if r.key == key]

    def per_key(self) -> dict[Any, int]:
        """How many reads each key saw."""
        return dict(Counter(r.key for r in self.reads))

    def describe(self, reads: list[HostRead] | None = None) -> str:
        """One line per distinct read (kind, site, culprit) with how often it happened."""
        counted = Counter(
            (r.kind, r.site, r.culprit) for r in (self.reads if reads is None else reads)
        )
        return "\n".join(
            f"{n} x {kind} at {site} (evendp: {culprit})"
            for (kind, site, culprit), n in counted.most_common()
        )


def optimizer_steps(optimizer: Callable[[], Any]) -> Callable[[torch.Tensor], bool]:
    """``ignore`` for the step counts in ``optimizer()``'s state (looked up at each read).

    torch's optimizers keep ``state["step"]`` on the CPU unless ``capturable`` or ``fused``,
    and read it with ``.item()`` every step (``torch.optim.optimizer._get_value``): a read
    of a host tensor, which a plain nanoGPT loop makes too and which waits for no device.

    >>> net = torch.nn.Linear(1, 1)
    >>> opt = torch.optim.AdamW(net.parameters())
    >>> net(torch.ones(1, 1)).sum().backward()
    >>> with HostReads(ignore=optimizer_steps(lambda: opt)) as reads:
    ...     opt.step()
    >>> reads.reads
    []
    """

    def ignore(tensor: torch.Tensor) -> bool:
        opt = optimizer()
        states = getattr(opt, "state", {})
        return any(s.get("step") is tensor for s in states.values() if isinstance(s, dict))

    return ignore


def culprits(reads: list[HostRead]) -> Iterator[str]:
    """The evendp functions (``file:function``) behind ``reads``, without line numbers."""
    for r in reads:
        yield (r.culprit or r.site).rsplit(":", 1)[0]
