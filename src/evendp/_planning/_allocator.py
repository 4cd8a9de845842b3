"""What PyTorch's CUDA caching allocator *reserves* for a training step, planned on a CPU.

A GPU runs out of what the caching allocator has reserved from the driver
(``torch.cuda.max_memory_reserved``), not of what tensors hold. This module models the
allocator and replays through it the storage events of a step recorded on fake tensors
(:class:`Trace`, filled by :mod:`._measure`), so the plan's peak on a CUDA device is the
reserved figure. What it models, with its sources (PyTorch 2.11 to 2.13):

- **Rounding and pools** (``c10/core/AllocatorConfig.h`` and
  ``c10/cuda/CUDACachingAllocator.cpp``, ``round_size``, ``get_allocation_size``,
  ``should_split``): every request is rounded up to 512 bytes (``kMinBlockSize``); requests
  of at most 1 MiB (``kSmallSize``) come from the small pool, carved from 2 MiB segments
  (``kSmallBuffer``); larger ones from the large pool: below 10 MiB (``kMinLargeAlloc``) a
  new segment is 20 MiB (``kLargeBuffer``), from 10 MiB on the request rounded up to 2 MiB
  (``kRoundLarge``). A request takes the smallest cached free block that holds it (best
  fit, then lowest address); a large block is split when more than 1 MiB would remain, a
  small one when at least 512 bytes would; a freed block merges with free neighbours of its
  segment. Segments are never returned during a step (only ``empty_cache`` or a failed
  ``cudaMalloc`` returns them): reserved memory only grows, so the reserved peak is what
  the steps reserved in all.
- **Expandable segments** (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; the same
  file, ``try_allocate_expandable_block``, and the CUDA semantics notes, "Optimizing memory
  usage with PYTORCH_CUDA_ALLOC_CONF"): one growing segment per pool and stream, mapped in
  pages of 2 MiB (small pool) or 20 MiB (large pool); blocks split whenever 512 bytes remain.
- **cuBLAS/cuBLASLt workspaces** (``aten/src/ATen/cuda/CublasHandlePool.cpp``,
  ``parseChosenWorkspaceSize``, ``getCUDABlasLtWorkspace``): one workspace per cuBLAS handle
  and stream, allocated through the caching allocator on the first matrix product and kept:
  ``CUBLAS_WORKSPACE_CONFIG`` (``:SIZE_KiB:COUNT`` summed), by default 32 MiB on compute
  capability 9.x, 10.x and 12.x (Hopper, Blackwell) and ``:4096:2:16:8`` (8 MiB + 128 KiB)
  elsewhere. cuBLASLt shares that workspace unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``,
  when it takes its own, ``CUBLASLT_WORKSPACE_SIZE`` KiB (default 1024). Handles are per
  thread: the forward runs on the caller's thread, the backward on autograd's device
  thread, so a training step holds two workspaces.
- **cuDNN convolution workspaces** (``aten/src/ATen/native/cudnn/Conv_v8.cpp``: the
  chosen engine's workspace is allocated through the caching allocator for the call and
  freed after it): :data:`CUDNN_WORKSPACE_FACTOR`.
- **Fragmentation** beyond what the replay sees: :data:`FRAGMENTATION` and :data:`SPARE`.

:func:`reserved_peak` is the entry point; :func:`alloc_conf_default` is the allocator
setting evendp's entry points choose.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "AllocatorConfig",
    "AllocatorOutOfMemory",
    "CachingAllocator",
    "CudaAllocatorModel",
    "Trace",
    "alloc_conf_default",
    "blas_workspace_bytes",
    "monotone_allocator",
    "reserved_peak",
    "with_allocator",
]

MIN_BLOCK = 512  # kMinBlockSize: every request is rounded up to a multiple of it
SMALL_SIZE = 1 << 20  # kSmallSize: the largest request served by the small pool
SMALL_BUFFER = 2 << 20  # kSmallBuffer: a small-pool segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer: a large-pool segment for a request below 10 MiB
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests get a segment rounded up to 2 MiB

#: A convolution call's transient cuDNN workspace, as a multiple of its largest operand
#: (input, weight, output or their gradients). cuDNN's engines and their workspaces are
#: cuDNN's choice; 1.05 is fitted to the one convolution row measured (H200, docs/planner.md).
CUDNN_WORKSPACE_FACTOR = 1.05

#: The fragmentation allowance on top of the replayed reserved peak ``R``: the plan reserves
#: ``max(R * (1 + FRAGMENTATION), R + SPARE)``. The replay sees the step's tensors, not the
#: kernels' own scratch (reductions, sorts, cuDNN's engine choice) nor the GPU's exact event
#: order; on the four H200 rows it reserved 0.86 to 1.0 of what the GPU did. Both constants
#: are fitted to those rows (docs/planner.md gives the figures): a fit to four points, not a
#: derivation, so the plan keeps its safety margin on top.
FRAGMENTATION = 0.09
SPARE = 36 << 20

#: The allocator setting evendp's entry points choose when the user chose none: see
#: :func:`alloc_conf_default`.
EXPANDABLE = "expandable_segments:True"

_BLAS_OPS = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot", "vdot",
     "_addmm_activation", "_scaled_mm", "_int_mm"}
)  # fmt: skip
_CONV_OPS = frozenset({"convolution", "convolution_backward", "cudnn_convolution"})


def round_size(nbytes: int) -> int:
    """A request's size in the allocator: at least 512 bytes, a multiple of 512
    (``round_size`` in CUDACachingAllocator.cpp, no ``roundup_power2_divisions``).

    >>> round_size(1), round_size(512), round_size(513)
    (512, 512, 1024)
    """
    return max(MIN_BLOCK, -(-int(nbytes) // MIN_BLOCK) * MIN_BLOCK)


def allocation_size(nbytes: int) -> int:
    """The segment ``cudaMalloc`` gets when no cached block holds a (rounded) request
    (``get_allocation_size`` in CUDACachingAllocator.cpp).

    >>> [allocation_size(n) >> 20 for n in (4096, 1 << 20, 3 << 20, 11 << 20, (11 << 20) + 1)]
    [2, 2, 20, 12, 12]
    """
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


def blas_workspace_bytes(major: int, env: Mapping[str, str] | None = None) -> int:
    """Bytes of one handle's cuBLAS and cuBLASLt workspaces (per stream) on a GPU of compute
    capability ``major``.x (``parseChosenWorkspaceSize`` in CublasHandlePool.cpp, torch >=
    2.10): ``CUBLAS_WORKSPACE_CONFIG`` when set (``:SIZE_KiB:COUNT`` entries summed), else 32
    MiB on Hopper and Blackwell (9, 10, 12) and ``:4096:2:16:8`` elsewhere; cuBLASLt adds
    nothing while the two are unified (the default; ``TORCH_CUBLASLT_UNIFIED_WORKSPACE``),
    else ``CUBLASLT_WORKSPACE_SIZE`` KiB, default 1024 (``parseCUDABlasLtWorkspaceSize``).

    >>> blas_workspace_bytes(9, {}) >> 20, blas_workspace_bytes(8, {})
    (32, 8519680)
    >>> blas_workspace_bytes(8, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}) >> 20
    32
    >>> blas_workspace_bytes(9, {"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"}) >> 20
    33
    """
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG")
    blas = (4096 * 8 << 10) if major in (9, 10, 12) else (4096 << 11) + (16 * 8 << 10)
    pairs = re.findall(r":([0-9]+):([0-9]+)", config or "")
    if pairs:
        blas = sum(int(size) * 1024 * int(count) for size, count in pairs)
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "1").strip().lower() in ("1", "true", "yes"):
        return blas
    try:
        return blas + int(env.get("CUBLASLT_WORKSPACE_SIZE", "1024")) * 1024
    except ValueError:
        return blas + 1024 * 1024  # torch warns and keeps its default


@dataclass(frozen=True)
class AllocatorConfig:
    """The allocator settings the model follows, read from ``PYTORCH_CUDA_ALLOC_CONF``.

    >>> AllocatorConfig.parse("expandable_segments:True").expandable_segments
    True
    >>> AllocatorConfig.parse("max_split_size_mb:128").max_split_size >> 20
    128
    """

    expandable_segments: bool = False
    max_split_size: int | None = None

    @classmethod
    def parse(cls, conf: str | None) -> AllocatorConfig:
        expandable, split = False, None
        for item in (conf or "").split(","):
            key, _, value = item.partition(":")
            key, value = key.strip(), value.strip()
            if key == "expandable_segments":
                expandable = value.lower() == "true"
            elif key == "max_split_size_mb" and value.isdigit():
                split = int(value) << 20
        return cls(expandable, split)

    @classmethod
    def current(cls) -> AllocatorConfig:
        """The setting a CUDA run started now would get."""
        return cls.parse(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))


def alloc_conf_default(env: MutableMapping[str, str] | None = None) -> str | None:
    """Set ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` in ``env`` (default
    ``os.environ``) when it is unset; return the value set, or ``None`` when the user's is kept.

    Why this setting: with expandable segments the allocator maps one growing range per
    pool instead of a new ``cudaMalloc`` segment per miss, so freed blocks of one size are
    reused for others and the reserved peak stays close to the allocated one; it is the
    setting PyTorch's notes recommend against fragmentation. It must be in the environment
    before CUDA initialises in the process (the allocator reads it once), so evendp's CLI
    sets it at start, before anything touches CUDA, and the processes it launches inherit it.

    >>> env = {}
    >>> alloc_conf_default(env), env
    ('expandable_segments:True', {'PYTORCH_CUDA_ALLOC_CONF': 'expandable_segments:True'})
    >>> alloc_conf_default({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}) is None
    True
    """
    env = os.environ if env is None else env
    if env.get("PYTORCH_CUDA_ALLOC_CONF") is not None:
        return None
    env["PYTORCH_CUDA_ALLOC_CONF"] = EXPANDABLE
    return EXPANDABLE


class Trace:
    """A fake step's storage events in order, as the allocator would see them.

    ``events`` holds ``("a", id, bytes)`` (a storage allocated), ``("f", id, 0)`` (freed),
    ``("w", thread, 0)`` (a cuBLAS call on the forward (0) or backward (1) thread: its
    workspace, once per thread) and ``("c", 0, bytes)`` (a convolution: a transient cuDNN
    workspace of about ``bytes``). ``step`` is the index where the step begins (the events
    before it made the batch).
    """

    def __init__(self) -> None:
        self.events: list[tuple[str, int, int]] = []
        self.kinds: dict[int, Any] = {}  # id -> MemTracker's winfo (its kind may change)
        self.step = 0
        self.closed = False
        self._ids: dict[int, int] = {}

    def storage(self, update: str, winfo: Any, old: int | None = None) -> None:
        """MemTracker's update ``update`` (ADD, DEL, SIZE, REF) of one storage."""
        if self.closed:
            return
        if update == "ADD":
            serial = len(self.kinds)
            self.kinds[serial] = winfo
            self._ids[id(winfo)] = serial
            self.events.append(("a", serial, int(winfo.mem_consumed)))
        elif update in ("DEL", "SIZE") and id(winfo) in self._ids:
            serial = self._ids[id(winfo)]
            self.events.append(("f", serial, 0))
            if update == "DEL":
                del self._ids[id(winfo)]
            else:  # resized in place: the allocator sees a new block
                self.events.append(("a", serial, int(winfo.mem_consumed)))

    def op(self, func: Any, backward: bool, args: Any) -> None:
        if self.closed:
            return
        name = getattr(getattr(func, "overloadpacket", func), "__name__", "")
        if name in _BLAS_OPS:
            self.events.append(("w", int(backward), 0))
        elif name in _CONV_OPS:
            sizes = [
                a.numel() * a.element_size()
                for a in args
                if hasattr(a, "numel") and hasattr(a, "element_size")
            ]
            self.events.append(("c", 0, max(sizes, default=0)))

    def mark_step(self) -> None:
        self.step = len(self.events)

    def close(self) -> None:
        """The step is over: storages freed from now on outlive it."""
        self.closed = True

    def kind(self, serial: int) -> str:
        return str(getattr(self.kinds[serial].reftype, "name", ""))


class AllocatorOutOfMemory(Exception):
    """The replay needed more than the cap even after returning every cached segment."""


@dataclass
class _Block:
    segment: int  # the segment's index: the best fit among equal sizes takes the first
    offset: int
    size: int
    small: bool
    free: bool = True
    prev: _Block | None = None
    next: _Block | None = None

    def key(self) -> tuple[int, int, int]:
        return (self.size, self.segment, self.offset)  # best fit, then lowest address


@dataclass
class _Segment:
    size: int  # mapped bytes (expandable: grows by pages)
    small: bool
    head: _Block | None = None


class CachingAllocator:
    """A replay model of one device's caching allocator on one stream.

    ``malloc(n)`` returns a handle, ``free(handle)`` gives it back; ``reserved`` (and its
    peak) and ``allocated`` (rounded bytes in use) follow. With ``cap`` (bytes, as
    ``torch.cuda.set_per_process_memory_fraction``), a miss that would pass it first returns
    every wholly free cached segment (as the real allocator does before it reports out of
    memory) and raises :class:`AllocatorOutOfMemory` if that is not enough.

    >>> a = CachingAllocator()
    >>> x = a.malloc(3 << 20)  # 3 MiB: a 20 MiB segment, split
    >>> y = a.malloc(4 << 20)  # served from the rest of it
    >>> a.reserved >> 20, a.allocated >> 20
    (20, 7)
    >>> a.free(x); a.free(y); a.reserved >> 20, a.allocated
    (20, 0)
    """

    def __init__(self, config: AllocatorConfig | None = None, cap: int | None = None) -> None:
        self.config = config or AllocatorConfig()
        self.cap = cap
        self.segments: list[_Segment] = []
        self._free: dict[bool, list[tuple[int, int, int]]] = {True: [], False: []}
        self._blocks: dict[tuple[int, int, int], _Block] = {}
        self._growing: dict[bool, int] = {}  # expandable: the segment of each pool
        self.reserved = self.allocated = self.peak_reserved = 0

    # -- the free lists: (size, segment, offset) sorted, best fit first ----------------
    def _insert(self, b: _Block) -> None:
        b.free = True
        bisect.insort(self._free[b.small], b.key())
        self._blocks[b.key()] = b

    def _remove(self, b: _Block) -> None:
        lst = self._free[b.small]
        i = bisect.bisect_left(lst, b.key())
        del lst[i]
        del self._blocks[b.key()]

    def _best_fit(self, size: int, small: bool) -> _Block | None:
        lst = self._free[small]
        i = bisect.bisect_left(lst, (size, -(1 << 62), -1))
        if i == len(lst):
            return None
        b = self._blocks[lst[i]]
        limit = self.config.max_split_size
        oversize = limit is not None and (
            size < limit <= b.size or (size >= limit and b.size >= size + LARGE_BUFFER)
        )
        if oversize and not self.config.expandable_segments:
            return None  # get_free_block: an oversize block is not split for a smaller request
        return b

    def _should_split(self, b: _Block, size: int) -> bool:
        remaining = b.size - size
        if b.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        limit = self.config.max_split_size
        return (limit is None or size < limit) and remaining > SMALL_SIZE

    # -- new memory from the driver -----------------------------------------------------
    def _grow(self, amount: int) -> None:
        if self.cap is not None and self.reserved + amount > self.cap:
            self.release_cached()
            if self.reserved + amount > self.cap:
                raise AllocatorOutOfMemory(amount)
        self.reserved += amount
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def _new_segment(self, size: int, small: bool) -> _Block:
        amount = allocation_size(size)
        self._grow(amount)
        seg = _Segment(amount, small)
        self.segments.append(seg)
        seg.head = _Block(len(self.segments) - 1, 0, amount, small)
        return seg.head

    def _expand(self, size: int, small: bool) -> _Block:
        page = SMALL_BUFFER if small else LARGE_BUFFER
        if small not in self._growing:
            self.segments.append(_Segment(0, small))
            self._growing[small] = len(self.segments) - 1
        index = self._growing[small]
        seg = self.segments[index]
        tail = seg.head
        while tail is not None and tail.next is not None:
            tail = tail.next
        have = tail.size if tail is not None and tail.free else 0
        more = -(-(size - have) // page) * page
        self._grow(more)
        start = seg.size
        seg.size += more
        if have:
            assert tail is not None
            self._remove(tail)
            tail.size += more
            return tail
        block = _Block(index, start, more, small, prev=tail)
        if tail is None:
            seg.head = block
        else:
            tail.next = block
        return block

    def release_cached(self) -> None:
        """Return every wholly free segment (and an expandable segment's free tail pages)."""
        for i, seg in enumerate(self.segments):
            head = seg.head
            if head is None:
                continue
            if i in self._growing.values():
                tail = head
                while tail.next is not None:
                    tail = tail.next
                page = SMALL_BUFFER if seg.small else LARGE_BUFFER
                cut = (tail.size // page) * page if tail.free else 0
                if cut:
                    self._remove(tail)
                    tail.size -= cut
                    seg.size -= cut
                    self.reserved -= cut
                    if tail.size:
                        self._insert(tail)
                    elif tail.prev is None:
                        seg.head = None
                    else:
                        tail.prev.next = None
            elif head.free and head.next is None:
                self._remove(head)
                self.reserved -= seg.size
                seg.size, seg.head = 0, None

    # -- the client's calls -------------------------------------------------------------
    def malloc(self, nbytes: int) -> _Block:
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        b = self._best_fit(size, small)
        if b is not None:
            self._remove(b)
        elif self.config.expandable_segments:
            b = self._expand(size, small)
        else:
            b = self._new_segment(size, small)
        if self._should_split(b, size):
            rest = _Block(b.segment, b.offset + size, b.size - size, small, prev=b, next=b.next)
            if b.next is not None:
                b.next.prev = rest
            b.next, b.size = rest, size
            self._insert(rest)
        b.free = False
        self.allocated += b.size
        return b

    def free(self, b: _Block) -> None:
        self.allocated -= b.size
        for other in (b.prev, b.next):
            if other is not None and other.free:
                self._remove(other)
                if other is b.prev:
                    other.size += b.size
                    other.next = b.next
                    if b.next is not None:
                        b.next.prev = other
                    b = other
                else:
                    b.size += other.size
                    b.next = other.next
                    if other.next is not None:
                        other.next.prev = b
        self._insert(b)


@dataclass(frozen=True)
class Reserved:
    """A replay's result: the reserved peak in bytes, the tensors' own peak (exact bytes, no
    rounding or workspaces) and the reserved figure to plan."""

    reserved: int
    tensors: int
    planned: int


_HELD = ("PARAM", "BUFFER", "OPT", "GRAD")  # kinds that outlive a step when never freed


def reserved_peak(
    trace: Trace,
    *,
    major: int = 9,
    config: AllocatorConfig | None = None,
    steps: int = 3,
    workspaces_held: bool = False,
    cap: int | None = None,
    env: Mapping[str, str] | None = None,
) -> Reserved:
    """Replay ``steps`` training steps of ``trace`` through :class:`CachingAllocator`, as a
    training loop runs them: the parameters first (``model.to("cuda")``), then each step's
    batch (the previous batch freed once the next one is in), its forward, backward and
    optimizer step; what the step never frees is kept if it is parameters, gradients or
    optimizer state, and let go at the step's end otherwise. cuBLAS workspaces for a GPU of
    compute capability ``major`` are taken on each thread's first matrix product
    (``workspaces_held``: they exist already, as in a process that ran one before), cuDNN's
    around each convolution.

    ``planned`` is the reserved peak with the fragmentation allowance
    (:data:`FRAGMENTATION`, :data:`SPARE`), rounded up to 2 MiB.
    Raises :class:`AllocatorOutOfMemory` when ``cap`` is too small.
    """
    sim = CachingAllocator(config, cap)
    blas = blas_workspace_bytes(major, env)
    events = trace.events
    final = {s: trace.kind(s) for s in trace.kinds}
    freed = {s for e, s, _ in events if e == "f"}
    held = {s for s in final if s not in freed and final[s] in _HELD}
    sizes = {s: nbytes for e, s, nbytes in events if e == "a"}
    live: dict[int, _Block] = {}
    for e, s, nbytes in events:  # model.to("cuda"): parameters and buffers first
        if e == "a" and final[s] in ("PARAM", "BUFFER") and s not in live:
            live[s] = sim.malloc(nbytes)
    workspaces: set[int] = {0, 1} if workspaces_held else set()
    tensors = peak_tensors = sum(b.size for b in live.values())
    last_batch: list[tuple[_Block, int]] = []
    for step in range(steps):
        batch: list[int] = []
        for i, (e, s, nbytes) in enumerate(events):
            if i == trace.step:  # the new batch is in: the last one goes
                for block, nbytes_old in last_batch:
                    sim.free(block)
                    tensors -= nbytes_old
            if e == "a":
                if s in live or (step and s in held):
                    continue
                live[s] = sim.malloc(nbytes)
                tensors += nbytes
                peak_tensors = max(peak_tensors, tensors)
                if i < trace.step:
                    batch.append(s)
            elif e == "f" and s in live:
                sim.free(live.pop(s))
                tensors -= sizes[s]
            elif e == "w" and s not in workspaces:
                workspaces.add(s)
                sim.malloc(blas)
            elif e == "c" and nbytes:
                sim.free(sim.malloc(math.ceil(nbytes * CUDNN_WORKSPACE_FACTOR)))
        for s in [s for s in live if s not in held and s not in batch]:
            sim.free(live.pop(s))  # the step's leftovers (outputs, loss) go with it
            tensors -= sizes[s]
        # The batch lives on until the next one is in (``batch = next(it)`` rebinds it).
        last_batch = [(live.pop(s), sizes[s]) for s in batch if s in live]
    frag = max(sim.peak_reserved * (1 + FRAGMENTATION), sim.peak_reserved + SPARE)
    planned = -(-int(frag) // ROUND_LARGE) * ROUND_LARGE
    return Reserved(sim.peak_reserved, peak_tensors, planned)


@dataclass(frozen=True)
class CudaAllocatorModel:
    """The CUDA device a plan's steps are replayed for: its compute capability's major
    number (it sets the cuBLAS workspace) and the allocator's setting.

    ``major`` 9 (Hopper) when the GPU is not known: its 32 MiB workspaces are the largest
    default, so a plan made for an unknown GPU does not count too few.

    >>> CudaAllocatorModel().major, CudaAllocatorModel(8).major
    (9, 8)
    """

    major: int = 9
    config: AllocatorConfig = field(default_factory=AllocatorConfig.current)

    @classmethod
    def live(cls, index: int) -> CudaAllocatorModel:  # pragma: no cover - needs a GPU
        # --- GPU-only: the device's compute capability. ---
        import torch

        return cls(torch.cuda.get_device_capability(index)[0])

    def reserved(self, trace: Trace) -> Reserved:
        return reserved_peak(trace, major=self.major, config=self.config)


def with_allocator(point: Any, model: CudaAllocatorModel) -> Any:
    """``point`` (a :class:`._measure.Point`) with the allocator's bytes beyond its tensors
    as one more kind at the forward+backward peak, ``"allocator"``: the planned reserved
    figure minus the replay's own tensor peak (rounding, segments, workspaces, fragmentation).
    """
    if point.trace is None or not point.trace.events:
        return point
    r = model.reserved(point.trace)
    extra = float(max(0, r.planned - r.tensors))
    return dataclasses.replace(point, fwbw={**point.fwbw, "allocator": extra})


def monotone_allocator(points: dict[int, Any]) -> dict[int, Any]:
    """``points`` (batch size -> :class:`._measure.Point`) with each size's ``"allocator"``
    bytes raised to the most any smaller size measured: the overhead is a step function of
    the segments a replay happened to make, and a curve through it must not fall as the
    batch grows (the solver's chords and its bound on extrapolation assume a rising peak).
    """
    out, most = {}, 0.0
    for n in sorted(points):
        p = points[n]
        if "allocator" in p.fwbw:
            most = max(most, p.fwbw["allocator"])
            p = dataclasses.replace(p, fwbw={**p.fwbw, "allocator": most})
        out[n] = p
    return out
