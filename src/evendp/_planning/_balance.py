"""Balance where users train: one engine behind the Trainer, the CLI and the integrations.

Two decisions, each made the same way on every rank:

* **Speed** (``balance="speed"``): :func:`step_balancer` puts a :class:`~evendp.SpeedBalancer`
  on the run's sampler. Each rank times its own forward passes; at a step boundary the ranks
  exchange their seconds per sample (one small ``all_gather``) and all apply the same new
  split: samples move from slow ranks to fast ones. Each step's samples are fixed by the
  permutation and the global batch, which never change, so the run trains on the same global
  batches as one process, with the same gradient; only which rank runs which samples moves.
  Whoever drives the loop calls ``measure(n)`` around the forward and ``step()`` once per
  optimizer step; with no balance both do nothing (:class:`NoBalance`).
* **Memory** (``batch_sizes="auto"``): :func:`auto_batch_sizes` plans the real model's step
  on this rank's own memory (:func:`evendp.plan` on fake tensors, no real memory touched),
  gathers every rank's capacity (one ``all_gather``) and splits the global batch by them, so
  every rank computes the same sizes with no file and no launcher. The memory is this rank's
  live free memory on a GPU, or declared (``memory=`` or ``EVENDP_MEMORY``, one entry per
  rank), which is how it is tested on CPU.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from .._core._defaults import BALANCES
from .._core._errors import EvendpError, PlanError
from .._core._units import format_bytes, parse_bytes
from .._core._validate import shown, validate_callable, validate_int
from .._distributed._batch_plan import BatchPlan, validate_batch_sizes_option
from .._distributed._group import comm_device
from ._memory import DeviceMemory, live_memory, parse_memory
from ._speed import SpeedBalancer, balance_sizes

__all__ = [
    "auto_memory",
    "device_sizes_for_memory",
    "device_weights_for_memory",
    "BALANCES",
    "ENV_MEMORY",
    "NoBalance",
    "auto_batch_sizes",
    "first_batch",
    "inline_for_balance",
    "rank_batch_plan",
    "rank_memory",
    "planned_rank_sizes",
    "say_auto_sizes",
    "sizes_from_capacities",
    "split_per_step",
    "step_balancer",
    "validate_balance",
]

Balance = Literal["none", "speed"]

# Declared memory of every rank ("24GiB,12GiB"), read by batch_sizes="auto" where no GPU says.
ENV_MEMORY = "EVENDP_MEMORY"


def validate_balance(balance: object, name: str = "balance") -> Balance:
    """``"none"`` or ``"speed"`` (``None`` means ``"none"``), else :class:`EvendpError`.

    >>> validate_balance(None), validate_balance("speed")
    ('none', 'speed')
    """
    if balance is None:
        return "none"
    if balance not in BALANCES:
        raise EvendpError(
            f"{name}={shown(balance)} is not a balance; expected one of {BALANCES} ('speed' moves "
            "samples from slow ranks to fast ones at step boundaries)"
        )
    return balance  # type: ignore[return-value]


class NoBalance:
    """What a run without speed balance calls: measuring and stepping do nothing.

    >>> b = NoBalance()
    >>> with b.measure(4):
    ...     pass
    >>> b.step(), b.history
    (False, [])
    """

    active = False

    def __init__(self) -> None:
        self.history: list[tuple[int, list[int]]] = []

    def measure(self, samples: int) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def step(self) -> bool:
        return False


def split_per_step(
    balancer: SpeedBalancer | NoBalance, sampler: Any, steps: int
) -> list[list[int]]:
    """Each rank's batch size in each of the last ``steps`` steps: the speed balancer's split
    at each (it counts the steps it was called on), else the sampler's one split.

    >>> from evendp import UnevenBatchSampler
    >>> split_per_step(NoBalance(), UnevenBatchSampler(8, [3, 1], rank=0), 2)
    [[3, 1], [3, 1]]
    """
    if not isinstance(balancer, SpeedBalancer):
        return [list(sampler.batch_sizes) for _ in range(steps)]
    last = balancer.steps
    return [balancer.sizes_at(step) for step in range(last - steps + 1, last + 1)]


def step_balancer(
    batch_sizes: Sequence[int],
    balance: object,
    *,
    distributed: bool = True,
    caps: Sequence[int] | None = None,
    apply: Callable[[list[int]], None] | None = None,
    **knobs: Any,
) -> SpeedBalancer | NoBalance:
    """The balancer a run calls at its step boundaries: speed balance or nothing.

    ``batch_sizes``: the split the run starts with (the sampler's); ``apply`` (the sampler's
    ``set_batch_sizes``) takes each new split, a checkpoint's too. ``caps`` bound each rank
    by its memory (``None``: the caps ``evendp launch --model`` left in
    ``EVENDP_BATCH_SIZES``, else no bound). One process (not ``distributed``) has no ranks to
    balance: nothing. ``knobs`` go to :class:`~evendp.SpeedBalancer` (``warmup``, ``every``,
    ``window``, ``tolerance``, an ``on_resplit`` of the caller's, called after ``apply``).

    >>> step_balancer([2, 2], "speed").world_size
    2
    >>> step_balancer([4], "speed", distributed=False).active
    False
    """
    if validate_balance(balance) == "none" or not distributed:
        return NoBalance()
    theirs = knobs.get("on_resplit")  # a bad value: named by SpeedBalancer
    if apply is not None and callable(theirs):  # the new split applied first, then theirs

        def both(sizes: list[int]) -> None:
            apply(sizes)
            theirs(sizes)

        knobs = {**knobs, "on_resplit": both}
    elif theirs is None:
        knobs = {**knobs, "on_resplit": apply}
    return SpeedBalancer(batch_sizes, caps, **knobs)


# ---------------------------------------------------------------------------------------------
# batch_sizes="auto": each rank's share from its own memory


def rank_memory(
    memory: str | Sequence[Any] | None = None,
    *,
    rank: int,
    world_size: int,
    environ: Mapping[str, str] | None = None,
) -> DeviceMemory:
    """This rank's memory: declared (``memory`` or ``EVENDP_MEMORY``), else read live (GPU).

    A declared spec has one entry per rank (``"24GiB,24GiB-10GiB"``) or one entry for all.

    >>> rank_memory("2GiB,1GiB", rank=1, world_size=2).free == 1 << 30
    True
    """
    env = os.environ if environ is None else environ
    spec = memory if memory is not None else env.get(ENV_MEMORY) or None
    if spec is None:
        # --- GPU only: this rank's own device, read now (NVML, or CUDA once it runs).
        return live_memory([_local_cuda_index()])[0]
    devices = parse_memory(spec)
    if len(devices) == 1:
        return devices[0]
    if len(devices) != world_size:
        raise EvendpError(
            f"memory spec {shown(spec)} has {len(devices)} entries for {world_size} ranks; give "
            "one "
            f"per rank (or one for all), e.g. {ENV_MEMORY}=24GiB,12GiB"
        )
    return devices[rank]


def _local_cuda_index() -> int:
    """The CUDA index this rank computes on (``LOCAL_RANK`` under torchrun). GPU only."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.current_device()
    return int(os.environ.get("LOCAL_RANK", "0"))


def sizes_from_capacities(caps: Sequence[int], global_batch: int | None = None) -> list[int]:
    """Per-rank sizes from per-rank capacities: the capacities, or ``global_batch`` split
    in proportion to them, never past one.

    >>> sizes_from_capacities([40, 20]), sizes_from_capacities([40, 20], 30)
    ([40, 20], [20, 10])
    >>> sizes_from_capacities([40, 0], 30)
    [30, 0]
    """
    caps = [int(c) for c in caps]
    if sum(caps) == 0:
        raise PlanError(
            f"no rank's memory holds one sample of this step (capacities {caps}); free memory, "
            "use activation checkpointing or a smaller model"
        )
    if global_batch is None:
        return caps
    if global_batch > sum(caps):
        raise PlanError(
            f"the global batch {global_batch} does not fit the ranks' memory, which holds "
            f"{sum(caps)} samples in all (per rank {caps}); lower the batch (and raise the "
            "gradient accumulation) or free memory"
        )
    # Minimizing max n_i / cap_i within the caps is the proportional split, in integers.
    times = [1.0 / c if c else 1.0 for c in caps]
    return balance_sizes(global_batch, times, caps)


def _gather_int(value: int, group: Any = None) -> list[int]:
    """Every rank's ``value`` (one all_gather); ``[value]`` without a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    local = torch.tensor([value], dtype=torch.int64, device=comm_device(group))
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    return [int(p.item()) for p in parts]


def auto_batch_sizes(
    model: nn.Module | Callable[[], nn.Module],
    batch: Any,
    *,
    global_batch: int | None = None,
    memory: str | Sequence[Any] | None = None,
    group: Any = None,
    **plan_options: Any,
) -> tuple[list[int], list[int]]:
    """``(sizes, caps)`` for every rank, planned from each rank's own memory, the same on all.

    Each rank plans the real model's step (``model`` on ``batch``, as :func:`evendp.plan`
    takes them, ``mode="ddp"``) on :func:`rank_memory`: the most samples its memory holds
    alone is its capacity. One ``all_gather`` gives every rank every capacity; the sizes are
    :func:`sizes_from_capacities` of them. A rank whose planning fails still joins the
    gather (so no rank hangs) and every rank raises the same error.

    >>> net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    >>> sizes, caps = auto_batch_sizes(net, torch.randn(1, 64), global_batch=32,
    ...                                memory="64MiB", cuda_context=0)
    >>> sizes == [32] and caps[0] >= 32
    True
    """
    initialized = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank(group) if initialized else 0
    world = dist.get_world_size(group) if initialized else 1
    from ._memory import DEFAULT_CONTEXT
    from ._planner import plan  # the planner pulls in fake tensors: only when asked

    if not torch.cuda.is_available():  # CPU ranks: there is no CUDA context to allow for
        plan_options.setdefault("cuda_context", 0)

    failure = ""
    try:
        mine = rank_memory(memory, rank=rank, world_size=world)
        cap = plan(model, batch, [mine], mode="ddp", **plan_options).devices[0].max_batch_alone
    except PlanError:
        cap = 0  # nothing fits this rank: it gets no samples
    except EvendpError as err:
        cap, failure = -1, str(err)
    caps = _gather_int(cap, group)
    if failure or -1 in caps:
        raise EvendpError(
            failure
            or f"planning batch_sizes='auto' failed on rank {caps.index(-1)} (see its error)"
        )
    try:
        return sizes_from_capacities(caps, global_batch), caps
    except PlanError as exc:
        context = parse_bytes(plan_options.get("cuda_context", DEFAULT_CONTEXT))
        if not context:
            raise
        raise PlanError(
            f"{exc} (each rank's memory also keeps {format_bytes(context)} for the CUDA "
            "context: cuda_context=, --context)"
        ) from None


def device_sizes_for_memory(
    model: nn.Module,
    batch: Any,
    devices: Sequence[torch.device],
    global_batch: int,
    *,
    memory: str | Sequence[Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[int], str]:
    """One process's ``"auto"``: the planner's split of ``global_batch`` over ``devices``
    (``mode="dp"``, ``model`` on ``batch`` as :func:`evendp.plan` takes them), and where each
    device's memory came from.

    The memory is :func:`auto_memory`'s: declared (``memory``, else ``EVENDP_MEMORY``), else
    read live on CUDA devices. Virtual CPU devices declare none: they split evenly, as
    ``BalancedDataParallel(weights="auto")`` does there, and the note says how to plan them.

    >>> net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    >>> cpu = [torch.device("cpu")] * 2
    >>> device_sizes_for_memory(net, torch.randn(1, 64), cpu, 16, environ={})
    ([8, 8], 'no memory to read on CPU devices: even (declare EVENDP_MEMORY=24MiB,12MiB to plan)')
    """
    from ._planner import plan  # the planner pulls in fake tensors: only when asked

    memories, source = auto_memory(devices, memory, environ)
    cuda = all(d.type == "cuda" for d in devices)
    if memories is None and not cuda:
        return balance_sizes(global_batch, [1.0] * len(devices)), source
    if memories is None:  # --- GPU only: live free memory, as BalancedDataParallel's "auto"
        from ._planner import auto_weights

        weights = auto_weights(model, list(devices), batch, gather_output=False)
        return balance_sizes(global_batch, [1.0 / w if w else 1e9 for w in weights]), source
    options: dict[str, Any] = {} if cuda else {"cuda_context": 0}  # CPU: no CUDA context
    planned = plan(model, batch, memories, mode="dp", batch_size=global_batch, **options)
    return list(planned.split), source


def device_weights_for_memory(
    model: nn.Module,
    example: Any,
    devices: Sequence[torch.device],
    *,
    output_device: int = 0,
    gather_output: bool = True,
    no_grad: bool = False,
    memory: str | Sequence[Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[float], str]:
    """``BalancedDataParallel(weights="auto")``: per-device weights (the largest split that
    fits, :func:`evendp._planning._planner.auto_weights` planning the program that runs) for
    :func:`auto_memory`'s memory, the Trainer's, and where that memory came from.

    >>> cpu = [torch.device("cpu")] * 2
    >>> weights, _ = device_weights_for_memory(nn.Linear(4, 2), torch.randn(3, 4), cpu,
    ...                                        environ={})
    >>> weights
    [1.0, 1.0]
    """
    from ._planner import auto_weights  # the planner pulls in fake tensors: only when asked

    memories, source = auto_memory(devices, memory, environ)
    # Declared memory is planned ahead, as plan() does (0.05); live memory keeps 0.1 back.
    margin = 0.1 if memories is None else 0.05
    weights = auto_weights(
        model, list(devices), example, output_device=output_device, safety_margin=margin,
        gather_output=gather_output, no_grad=no_grad, memory=memories,
    )  # fmt: skip
    return weights, source


def auto_memory(
    devices: Sequence[torch.device],
    memory: str | Sequence[Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> tuple[list[DeviceMemory] | None, str]:
    """Where one process's ``"auto"`` gets each device's memory, and a note saying where:
    declared (``memory``, else ``EVENDP_MEMORY``: one entry per device, or one for all), else
    ``None``: read live on CUDA devices, none on virtual CPU ones (they split evenly).

    >>> auto_memory([torch.device("cpu")] * 2, "2MiB")[1]
    'declared memory 2MiB'
    """
    env = os.environ if environ is None else environ
    spec = memory if memory is not None else env.get(ENV_MEMORY) or None
    if spec is None:
        if all(d.type == "cuda" for d in devices):
            return None, "each device's free memory"
        note = f"no memory to read on CPU devices: even (declare {ENV_MEMORY}=24MiB,12MiB to plan)"
        return None, note
    memories = parse_memory(spec)
    if len(memories) == 1:
        memories = memories * len(devices)
    if len(memories) != len(devices):
        raise EvendpError(
            f"memory spec {shown(spec)} has {len(memories)} entries for {len(devices)} "
            f"devices; give one per device (or one for all), e.g. {ENV_MEMORY}=24GiB,12GiB"
        )
    return memories, f"declared memory {spec}"


def say_auto_sizes(
    sizes: Sequence[int],
    caps: Sequence[int] | None,
    rank: int,
    *,
    option: str = "batch_sizes",
    per: str = "rank",
    source: str | None = None,
) -> None:
    """On rank 0: what ``"auto"`` chose, in one line (every surface says it): ``option``'s
    name, the sizes ``per`` rank (or device), and the capacities or the memory's ``source``.

    >>> say_auto_sizes([20, 12], [48, 24], rank=1)  # other ranks stay quiet
    """
    if rank != 0:
        return
    most = "" if caps is None else f" (the most each holds: {list(caps)})"
    most += "" if source is None else f" ({source})"
    print(
        f"evendp: {option}='auto' planned {list(sizes)} per {per} for a global batch of "
        f"{sum(sizes)}{most}",
        file=sys.stderr,
        flush=True,
    )


def planned_rank_sizes(
    model: nn.Module | None,
    example: Callable[[], Any],
    global_batch: int,
    *,
    memory: str | Sequence[Any] | None = None,
    where: str = "batch_sizes='auto'",
    **plan_options: Any,
) -> tuple[list[int], list[int]]:
    """``batch_sizes="auto"`` for a surface that takes per-rank sizes (``UnevenTrainer``, the
    integrations' ``uneven_dataloader``): :func:`auto_batch_sizes` on ``example()``, said once
    by :func:`say_auto_sizes`. ``where`` names the call that needs ``model`` in the refusal;
    ``plan_options`` go to the planner.

    >>> net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    >>> sizes, _ = planned_rank_sizes(
    ...     net, lambda: torch.randn(1, 64), 32, memory="64MiB", cuda_context=0)
    >>> sizes
    [32]
    """
    if model is None:
        raise EvendpError(
            f"{where} plans the model's step on a training sample, but no model was given; "
            "pass model= (the module whose first output is the loss) or explicit sizes"
        )
    validate_callable("example", example, "a function () -> one training sample as a batch")
    validate_int("global_batch", global_batch, minimum=0, allow_none=True, example="32")
    initialized = dist.is_available() and dist.is_initialized()
    sizes, caps = auto_batch_sizes(
        model, example(), global_batch=global_batch, memory=memory, **plan_options
    )
    say_auto_sizes(sizes, caps, dist.get_rank() if initialized else 0)
    return sizes, caps


def first_batch(data: Any, collate_fn: Callable[[list[Any]], Any] | None = None) -> Any:
    """The data's first sample as a one-sample batch (what the planner measures on)."""
    from .._distributed._collate import EmptySafeCollate

    if len(data) == 0:
        raise EvendpError("batch_sizes='auto' plans on a sample of the data, but it is empty")
    batch_fn = getattr(data, "batch", None) if collate_fn is None else None
    if callable(batch_fn):
        return batch_fn([0])
    return EmptySafeCollate(data, collate_fn)([data[0]])


def rank_batch_plan(
    batch_sizes: Sequence[int] | str | None,
    global_batch: int,
    world_size: int,
    *,
    model: Callable[[], nn.Module],
    example: Callable[[], Any],
    launched: BatchPlan | None = None,
) -> BatchPlan:
    """The run's :class:`~evendp._distributed._batch_plan.BatchPlan`: the launcher's, given,
    even, or planned for memory (``"auto"``, with each rank's cap), one size per rank of
    ``world_size``.

    ``launched``: the plan ``evendp launch`` left in ``EVENDP_BATCH_SIZES`` (caps included).
    It is the run's plan when the config gives no per-rank sizes; sizes given too must be the
    same, and a global batch given must be their sum (else an :class:`EvendpError` naming
    both), unless the launcher's sizes were its own default (``EVENDP_BATCH_DEFAULTED``):
    then the config's sizes or batch win. ``model()`` and ``example()`` are called only for
    ``"auto"`` (the module whose first scalar output is the step's loss, and one batch of the data).

    >>> rank_batch_plan(None, 10, 3, model=nn.Identity, example=list)
    BatchPlan(sizes=(4, 3, 3), caps=None, source='even')
    >>> rank_batch_plan(None, 10, 2, model=nn.Identity, example=list,
    ...                 launched=BatchPlan((12, 4))).sizes  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: TrainConfig(batch_size=10) contradicts the launcher's batch sizes ...
    """
    validate_batch_sizes_option(batch_sizes)
    if launched is not None and not _config_overrides_default(launched, batch_sizes, global_batch):
        return _launchers_plan(launched, batch_sizes, global_batch)
    if batch_sizes == "auto":  # planned and said as on every surface that takes sizes
        sizes, caps = planned_rank_sizes(model(), example, global_batch)
        return BatchPlan.of(sizes, caps, "planned for memory", world_size)
    if batch_sizes:
        return BatchPlan.of(batch_sizes, world_size=world_size)
    return BatchPlan.even(global_batch, world_size)


def _config_overrides_default(
    launched: BatchPlan, batch_sizes: Sequence[int] | str | None, global_batch: int
) -> bool:
    """Whether the config's own sizes or batch replace the launcher's default ones (the
    launcher was given none: its sizes are a guess, the script's are the user's choice)."""
    from .._core._defaults import NotGiven
    from .._distributed._launch_notes import ENV_BATCH_DEFAULTED, note_sizes_read

    if os.environ.get(ENV_BATCH_DEFAULTED) != "1":
        return False
    overrides = bool(batch_sizes) or not isinstance(global_batch, NotGiven)
    if overrides:
        note_sizes_read()  # read, and replaced on purpose: the launcher need not warn
    return overrides


def _launchers_plan(
    launched: BatchPlan, batch_sizes: Sequence[int] | str | None, global_batch: int
) -> BatchPlan:
    """The launcher's plan, which this rank now reads (the launcher does not warn); refused
    when the config says otherwise (which would win is not the Trainer's to guess)."""
    from .._core._defaults import NotGiven
    from .._distributed._launch_notes import note_sizes_read

    shown_sizes = ",".join(map(str, launched.sizes))
    fix = (
        f"drop it to train the launcher's EVENDP_BATCH_SIZES={shown_sizes}, or start the "
        "launcher with the sizes you want (evendp launch --batch-sizes ...)"
    )
    if batch_sizes == "auto" or (batch_sizes and list(batch_sizes) != list(launched.sizes)):
        raise EvendpError(
            f"TrainConfig(batch_sizes={batch_sizes!r}) contradicts the launcher's batch sizes "
            f"{list(launched.sizes)}; {fix}"
        )
    if not isinstance(global_batch, NotGiven) and global_batch != launched.global_batch:
        raise EvendpError(
            f"TrainConfig(batch_size={global_batch}) contradicts the launcher's batch sizes "
            f"{list(launched.sizes)} ({launched.global_batch} a step); {fix}"
        )
    note_sizes_read()
    return launched


def inline_for_balance(balancer: SpeedBalancer | NoBalance, asked: int | None, depth: int) -> int:
    """Batches to collate ahead: none under speed balance (a thread ahead would apply a new
    split at a step that depends on its timing, different on different ranks).

    >>> inline_for_balance(NoBalance(), None, 2)
    2
    """
    if not balancer.active:
        return depth
    if asked:
        raise EvendpError(
            f"prefetch={asked} collates batches ahead in a thread, but balance='speed' applies "
            "a new split at the next step on every rank alike, which a thread ahead would "
            "not; set prefetch=0 or None with balance='speed'"
        )
    return 0
