"""``evendp launch``: choose devices and per-rank batch sizes, then hand off to torchrun.

The launcher passes what every rank gets through the environment: which GPUs
(``CUDA_DEVICE_ORDER``/``CUDA_VISIBLE_DEVICES``) and one :class:`BatchPlan
<evendp._distributed._batch_plan.BatchPlan>` (``EVENDP_BATCH_SIZES="3,5;caps=48,24"``: each
global rank's samples per step and, when a model is planned, the most its memory holds).
Everything else is ``torch.distributed.run`` (torchrun) itself, with its own options, run
through :data:`~evendp._distributed._torchrun.QUIET_TORCHRUN` (one line on a signal, not a
traceback).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._core._errors import EvendpError
from .._core._split import split_even, split_sizes
from .._core._validate import shown, validate_int
from .._distributed._batch_plan import ENV_BATCH_SIZES, BatchPlan, Source, global_batch_size
from .._distributed._launch_notes import (
    ENV_OUTCOME,
    read_outcome,
    sizes_were_read,
    sizes_were_told,
    training_began,
    write_outcome,
)
from .._distributed._torchrun import QUIET_TORCHRUN
from .._distributed._torchrun._addresses import interface_toward, loopback_address
from .._distributed._torchrun._nodes import (
    ENV_EXIT_WAIT,
    ENV_TORCHRUN_LOG,
    EXIT_WAIT_S,
    TORCHRUN_EXIT_BARRIER_S,
)
from ._devices import NvmlUnavailableError, choose_devices, list_devices
from ._memory import DeviceMemory, parse_memory

if TYPE_CHECKING:
    from ._result import Plan

__all__ = [
    "ENV_OUTCOME",
    "LaunchPlan",
    "launch",
    "launch_with_outcome",
    "plan_launch",
    "read_outcome",
    "torchrun_command",
    "validate_passed_numbers",
    "write_outcome",
]

# torchrun options passed through unchanged (multi-node and rendezvous).
PASSTHROUGH_OPTIONS: tuple[str, ...] = (
    "nnodes",
    "node_rank",
    "rdzv_backend",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_conf",
    "master_addr",
    "master_port",
    "max_restarts",
)

# torchrun's default port; never used for local runs so two jobs cannot collide on it.
_TORCHRUN_DEFAULT_PORT = 29500


@dataclass(frozen=True)
class LaunchPlan:
    """What a launch will do: ranks on this node, batch sizes for all ranks, GPUs, env."""

    nproc_per_node: int
    batch_plan: BatchPlan | None  # None: the script's own sizes
    physical_devices: list[int] | None  # None: CPU processes (gloo)
    env: dict[str, str] = field(default_factory=dict)
    reason: str = ""
    memory_plan: Plan | None = field(default=None, repr=False, compare=False)

    @property
    def batch_sizes(self) -> list[int] | None:
        """Each global rank's samples per step (``None``: the script's own)."""
        return None if self.batch_plan is None else list(self.batch_plan.sizes)

    @property
    def batch_caps(self) -> list[int] | None:
        """Most samples each rank's memory holds (planned with a model; else ``None``)."""
        caps = None if self.batch_plan is None else self.batch_plan.caps
        return None if caps is None else list(caps)

    def describe(self) -> str:
        """One line for the log."""
        where = (
            "CPU (gloo)"
            if self.physical_devices is None
            else "GPUs " + ",".join(map(str, self.physical_devices)) + " (physical ids)"
        )
        sizes = "script default" if self.batch_sizes is None else str(self.batch_sizes)
        caps = "" if self.batch_caps is None else f", memory caps {self.batch_caps}"
        return (
            f"evendp launch: {self.nproc_per_node} rank(s) on this machine, {where}; "
            f"batch sizes {sizes}{caps}{' — ' + self.reason if self.reason else ''}"
        )


def least_run_ranks(here: int, nodes: int) -> int:
    """The fewest ranks a run of ``nodes`` machines has when this one starts ``here``: one on
    each other machine (machines may differ; the ranks check the true total).

    >>> least_run_ranks(2, 2), least_run_ranks(3, 1)
    (3, 3)
    """
    return here + nodes - 1


def _ranks_here(sizes: list[int], nodes: int, count: int | None) -> int:
    """This node's ranks for one size per rank of the whole run (node-major): ``count`` when
    given (nodes may differ: 2 GPUs here, 1 there; the ranks check the total), else an even
    share of the sizes."""
    if count is None:
        if len(sizes) % nodes:
            raise EvendpError(
                f"--batch-sizes has {len(sizes)} entries for {nodes} nodes, not the same number "
                "per node; give --nproc (this node's ranks) when the nodes differ"
            )
        return len(sizes) // nodes
    if nodes == 1 and count != len(sizes):
        raise EvendpError(
            f"--nproc {count} but --batch-sizes {sizes} has {len(sizes)}; drop --nproc or give "
            "one size per rank"
        )
    if len(sizes) < least_run_ranks(count, nodes):
        raise EvendpError(
            f"--batch-sizes has {len(sizes)} entries, but this node's {count} rank(s) and at "
            f"least one on each of the other {nodes - 1} node(s) need "
            f"{least_run_ranks(count, nodes)}; give "
            "one size per rank of the whole run (node 0's ranks first), the same list everywhere"
        )
    return count


def _fixed_nnodes(nnodes: str | int | None) -> int | None:
    """The node count when fixed, ``None`` for an elastic range such as ``"1:4"``."""
    if nnodes is None:
        return 1
    low, colon, high = str(nnodes).partition(":")
    try:
        value = int(low)
        if colon and int(high) != value:
            return None
    except ValueError:
        raise EvendpError(f"--nnodes {shown(nnodes)} is not an int or MIN:MAX range") from None
    if not 1 <= value <= 100_000:
        raise EvendpError(f"--nnodes must be an int in [1, 100000], got {shown(nnodes)}")
    return value


#: The passed-through options that are numbers: their ranges (torchrun would take 99999 as a
#: port and fail only when it binds).
_PASSED_NUMBERS = {"master_port": (1, 65535), "node_rank": (0, 99_999), "max_restarts": (0, 1000)}


def validate_passed_numbers(given: Mapping[str, str | int | None]) -> None:
    """The passed-through ports, node ranks and restart counts are ints in their ranges."""
    for key, (low, high) in _PASSED_NUMBERS.items():
        if given.get(key) is None:
            continue
        flag = "--" + key.replace("_", "-")
        try:
            value = int(str(given[key]))
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            raise EvendpError(
                f"{flag} must be an int in [{low}, {high}], got {shown(given[key])}; e.g. "
                f"{flag} {low if key != 'master_port' else 29501}"
            )


#: The most ranks one node starts: each is a process (and a GPU); more is a typo, and a plan for
#: a million ranks would build a million of everything before torchrun refused it.
MAX_NPROC = 1024


def _validate_nproc(nproc: int | str | None) -> int | None:
    """``None`` for ``auto``; else a positive int."""
    if nproc is None or nproc == "auto":
        return None
    try:
        value = int(nproc)
    except (TypeError, ValueError):
        raise EvendpError(f"--nproc must be a positive int or 'auto', got {shown(nproc)}") from None
    if not 1 <= value <= MAX_NPROC:
        raise EvendpError(
            f"--nproc must be a positive int or 'auto' (at most {MAX_NPROC} ranks per node), "
            f"got {shown(nproc)}; e.g. --nproc 8 (one rank per GPU)"
        )
    return value


def _validate_model_inputs(
    model: Any,
    example_batch: Any,
    memory: Any,
    plan_options: Mapping[str, Any] | None,
    batch_sizes: Any,
    nodes: int,
) -> None:
    """Planning options must come together, on one node, and without fixed sizes."""
    if model is None:
        if example_batch is not None or plan_options:
            raise EvendpError(
                "example_batch and plan_options only apply when planning a model; pass "
                "model= (--model on the command line) or drop them"
            )
    elif example_batch is None:
        raise EvendpError(
            "model= needs example_batch= (a batch, or a function of the batch size) so the "
            "planner can run it; on the command line --model supplies both"
        )
    if batch_sizes is not None and (model is not None or memory is not None):
        raise EvendpError(
            f"--batch-sizes {batch_sizes} fixes every rank's share, so there is nothing to plan; "
            "drop --batch-sizes, or drop --model/--memory"
        )
    if nodes != 1 and (model is not None or memory is not None):
        raise EvendpError(
            f"--model/--memory plan this node's devices only, but --nnodes is {nodes}; on "
            "several nodes run `evendp plan` for the whole job and pass one --batch-sizes "
            "list (node-major) on every node"
        )
    bad = sorted({"mode", "batch_size", "devices", "memory"} & set(plan_options or {}))
    if bad:
        raise EvendpError(
            f"plan_options may not set {bad}: the launcher plans mode='ddp' on the ranks' "
            "devices with --batch as the global batch"
        )


def plan_launch(
    nproc: int | str | None = "auto",
    batch: int | None = None,
    batch_sizes: str | Sequence[int] | None = None,
    gpu_ids: Sequence[int] | None = None,
    min_free: int | str | None = None,
    nnodes: str | int | None = None,
    nvml: Any = None,
    *,
    model: Any = None,
    example_batch: Any = None,
    memory: str | Sequence[int | str] | None = None,
    plan_options: Mapping[str, Any] | None = None,
) -> LaunchPlan:
    """Decide ranks, devices and per-rank batch sizes for this node (no process started).

    With GPUs (NVML): the given physical ``gpu_ids`` (NVML / ``nvidia-smi`` order), else the
    freest ``nproc`` (all when ``auto``, or as many as ``memory`` declares). With no NVIDIA
    driver: CPU ranks (``auto`` = the CPU count, as torchrun does, or one per ``memory`` entry).

    Per-rank batch sizes, first that applies:

    - ``batch_sizes``: given; they fix the rank count.
    - ``model`` (and ``example_batch``, as :func:`evendp.plan` takes them): the planner's DDP
      split of ``batch`` (``None``: the largest batch that fits) over each rank's memory:
      ``memory`` when declared (``"24GiB,24GiB,12GiB"``, one entry per rank; needed on CPU),
      else the chosen GPUs' free memory read now through NVML. ``plan_options`` go to
      :func:`evendp.plan` (``optimizer``, ``amp``, ``safety_margin``...). The most samples each
      rank's memory holds alone travel with the sizes, as ``EVENDP_BATCH_SIZES="3,5;caps=48,24"``,
      for ``SpeedBalancer``. :class:`evendp.PlanError` when the batch fits nowhere.
    - ``batch`` alone: split in proportion to ``memory`` when declared, else to each chosen
      GPU's free memory, else evenly (CPU).

    With several nodes the sizes cover every global rank (node-major) and must be given, or
    ``batch`` is split evenly, because one node cannot see the others' memory. ``batch`` with
    ``batch_sizes`` must be their sum (``batch`` is the global batch, the sizes its shares).

    >>> p = plan_launch(nproc=2, batch_sizes="3,5", nvml=False)
    >>> p.nproc_per_node, p.batch_sizes, p.env["EVENDP_BATCH_SIZES"]
    (2, [3, 5], '3,5')
    >>> plan_launch(nproc=3, batch=10, nvml=False).batch_sizes
    [4, 3, 3]
    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
    ...                           torch.nn.Linear(1024, 10))
    >>> p = plan_launch(batch=9000, nvml=False, model=net, example_batch=torch.randn(1, 256),
    ...                 memory="64MiB,64MiB,32MiB", plan_options={"cuda_context": 0})
    >>> sum(p.batch_sizes), p.batch_sizes[2] < p.batch_sizes[0] <= p.batch_caps[0]
    (9000, True)
    >>> sorted(p.env), p.batch_plan.source
    (['EVENDP_BATCH_SIZES'], 'planned for memory')
    """
    count = _validate_nproc(nproc)
    nodes = _fixed_nnodes(nnodes)
    if batch is not None:
        validate_int("--batch", batch, minimum=1, example="--batch 64")
    sizes = None
    if batch_sizes is not None:
        given = isinstance(batch_sizes, str)  # a list: the command line read it already
        plan = BatchPlan.parse(batch_sizes) if given else BatchPlan.of(batch_sizes)
        sizes = list(plan.sizes)
        if batch is not None:
            global_batch_size(batch, sizes, cli="--batch-sizes ")
    if nodes is None and (sizes is not None or batch is not None or model is not None):
        raise EvendpError(
            f"--nnodes {nnodes} is an elastic range, so the number of ranks (and the batch size "
            "of each) is not known before the run; use a fixed --nnodes N"
        )
    nodes = 1 if nodes is None else nodes
    _validate_model_inputs(model, example_batch, memory, plan_options, batch_sizes, nodes)
    declared = None if memory is None else parse_memory(memory)
    if declared is not None:
        if count is not None and count != len(declared):
            raise EvendpError(
                f"--nproc {count} but --memory declares {len(declared)} devices; give one "
                "memory entry per rank, or drop --nproc"
            )
        count = len(declared)
    if sizes is not None:
        count = _ranks_here(sizes, nodes, count)
    if count is not None and count > MAX_NPROC:
        raise EvendpError(
            f"{'--batch-sizes' if sizes is not None else '--memory'} gives {count} ranks per "
            f"node, more than {MAX_NPROC} (the --nproc limit); give one entry per rank"
        )

    # Which GPUs; nvml=False means "do not ask NVML" (CPU planning, tests, doctests).
    try:
        gpus = [] if nvml is False else list_devices(nvml)
    except NvmlUnavailableError:
        gpus = []
    env: dict[str, str] = {}
    physical: list[int] | None = None
    reason = ""
    mems = declared
    if gpus:
        chosen = choose_devices(
            gpus, count=None if gpu_ids else count, ids=gpu_ids, min_free=min_free
        )
        if count is not None and len(chosen) != count:
            raise EvendpError(
                f"--gpus {list(gpu_ids or [])} names {len(chosen)} GPUs but {count} ranks "
                "per node were asked for; give one device per rank"
            )
        physical = [d.index for d in chosen]
        count = len(chosen)
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, physical))
        if mems is None:  # the chosen GPUs' free memory as NVML read it, by physical id
            mems = [DeviceMemory(f"gpu{d.index}", d.free_memory, d.total_memory) for d in chosen]
    else:
        if gpu_ids:
            raise EvendpError(
                f"--gpus {list(gpu_ids)} asks for GPUs but no NVIDIA driver was found; "
                "drop --gpus to run CPU processes with gloo"
            )
        if count is None:
            count = os.cpu_count() or 1
    source: Source = "given"
    if batch is not None and sizes is None and model is None:
        # Declared memory with several nodes was refused above; free memory is read per node.
        if nodes == 1 and mems is not None:
            sizes = split_sizes(batch, [m.free for m in mems])
            reason = "split by " + ("declared" if declared else "free") + " memory"
            source = "planned for memory"
        else:
            source = "even"
            sizes = split_even(batch, count * nodes)
            reason = (
                "split evenly: other nodes' memory is not visible from here"
                if gpus
                else "split evenly across CPU ranks"
            )
    memory_plan = None
    caps = None
    if model is not None:
        if mems is None:  # no GPU was found to read, and none declared
            raise EvendpError(
                "--model needs each rank's memory, and no NVIDIA driver was found to read it; "
                "declare it with --memory, e.g. --memory 24GiB,24GiB,12GiB (one entry per rank)"
            )
        from ._planner import plan as plan_memory  # fake tensors: only loaded when asked

        memory_plan = plan_memory(
            model, example_batch, mems, mode="ddp", batch_size=batch, **(plan_options or {})
        )
        sizes = list(memory_plan.split)
        caps = tuple(d.max_batch_alone for d in memory_plan.devices)
        source = "planned for memory"
        reason = (
            f"planned (ddp) on {'declared' if declared else 'free'} memory: global batch "
            f"{memory_plan.global_batch}, eta_mem {memory_plan.eta_mem:.2f} "
            f"(even split {memory_plan.even_eta_mem:.2f})"
        )
    batch_plan = None if sizes is None else BatchPlan.of(sizes, caps, source)
    env.update({} if batch_plan is None else batch_plan.env())
    return LaunchPlan(count, batch_plan, physical, env, reason, memory_plan)


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port: int = sock.getsockname()[1]
        if port != _TORCHRUN_DEFAULT_PORT:
            return port


_TORCHRUN_MODULE = ("-m", "torch.distributed.run")


def torchrun_command(
    plan: LaunchPlan,
    script: str,
    script_args: Sequence[str] = (),
    passthrough: Mapping[str, str | int | None] | None = None,
) -> list[str]:
    """The ``python -m torch.distributed.run ...`` command line for ``plan``.

    Multi-node options in ``passthrough`` (keys from :data:`PASSTHROUGH_OPTIONS`) go through
    unchanged. A single-node run with no address given gets ``127.0.0.1`` and a free port
    (never torchrun's default 29500, which two jobs on one box would fight over).

    >>> plan = plan_launch(nproc=2, batch_sizes="3,5", nvml=False)
    >>> cmd = torchrun_command(plan, "train.py", ["--lr", "0.1"], {"master_port": 1234})
    >>> cmd[1:5]
    ['-m', 'torch.distributed.run', '--nproc-per-node', '2']
    >>> cmd[5:]
    ['--master-addr', '127.0.0.1', '--master-port', '1234', 'train.py', '--lr', '0.1']
    """
    given = {k: v for k, v in (passthrough or {}).items() if v is not None}
    unknown = sorted(set(given) - set(PASSTHROUGH_OPTIONS))
    if unknown:
        raise EvendpError(
            f"unknown torchrun option(s) {unknown}; evendp launch passes through "
            f"{list(PASSTHROUGH_OPTIONS)}"
        )
    validate_passed_numbers(given)
    single_node = _fixed_nnodes(given.get("nnodes")) == 1
    if single_node and "rdzv_endpoint" not in given:
        given.setdefault("master_addr", "127.0.0.1")
        given.setdefault("master_port", _free_port())
    cmd = [sys.executable, *_TORCHRUN_MODULE, "--nproc-per-node", str(plan.nproc_per_node)]
    for key in PASSTHROUGH_OPTIONS:
        if key in given:
            cmd += ["--" + key.replace("_", "-"), str(given[key])]
    return [*cmd, script, *script_args]


def interface_env(torchrun: Sequence[str]) -> dict[str, str]:
    """The variables that keep the ranks' own sockets on the network of the run's rendezvous
    address (``--master-addr``, ``--rdzv-endpoint``) in a torchrun command: at a loopback
    address (a one-machine run) gloo and NCCL listen on loopback; at another, gloo listens on
    the interface that reaches it (NCCL, which picks its fastest fabric, is left to choose).

    >>> interface_env(["python", "-m", "torch.distributed.run", "--master-addr", "127.0.0.1"])
    {'GLOO_SOCKET_IFNAME': 'lo', 'NCCL_SOCKET_IFNAME': 'lo'}
    >>> interface_env(["python", "-m", "torch.distributed.run", "--master-addr", "no.invalid"])
    {}
    """
    args = list(torchrun)
    hosts = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--master-addr"]
    hosts += [
        args[i + 1].rsplit(":", 1)[0].strip("[]")  # HOST:PORT, [::1]:PORT
        for i, a in enumerate(args[:-1])
        if a == "--rdzv-endpoint"
    ]
    if not hosts:
        return {}
    if all(loopback_address(h) for h in hosts):
        lo = "lo0" if sys.platform == "darwin" else "lo"
        return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}
    names = {interface_toward(h) for h in hosts}
    name = names.pop() if len(names) == 1 else None
    return {} if name is None else {"GLOO_SOCKET_IFNAME": name}


def launch(
    script: str,
    script_args: Sequence[str] = (),
    *,
    plan: LaunchPlan,
    passthrough: Mapping[str, str | int | None] | None = None,
    env: Mapping[str, str] | None = None,
    run_dir: str | Path | None = None,
) -> int:
    """Run ``script`` under torchrun as ``plan`` says; returns the run's exit code (see
    :func:`launch_with_outcome`)."""
    return launch_with_outcome(
        script, script_args, plan=plan, passthrough=passthrough, env=env, run_dir=run_dir
    )[0]


def launch_with_outcome(
    script: str,
    script_args: Sequence[str] = (),
    *,
    plan: LaunchPlan,
    passthrough: Mapping[str, str | int | None] | None = None,
    env: Mapping[str, str] | None = None,
    run_dir: str | Path | None = None,
    comm_timeout: float | None = None,
    trainer: bool = False,
) -> tuple[int, dict[str, Any] | None]:
    """Run ``script`` under torchrun as ``plan`` says; returns the exit code and what rank 0
    left with :func:`write_outcome` (``None``: nothing); its code wins (0 for a run that
    finished although a signal came late).

    The plan's variables go into a copy of ``env`` (default: this process's environment).
    SIGINT/SIGTERM/SIGHUP go to the ranks (:mod:`evendp._distributed._interrupt`: 130/143);
    a signal they have not acted on a minute past ``comm_timeout`` (far sooner before a
    ``trainer`` says training began) goes to torchrun, which escalates to SIGKILL. ``run_dir``
    is locked for the run's life (:mod:`evendp._distributed._run_lock`). A peer that stopped
    answering (:mod:`evendp._distributed._stalled`) ends the run in one line, exit 1; a run
    that ended 0 with no rank reading the plan's sizes gets a warning on stderr.
    """
    from .._distributed._interrupt import ESCALATE_S, run_forwarding_signals
    from .._distributed._run_files import run_files_dir
    from .._distributed._run_lock import child_env as lock_env
    from .._distributed._run_lock import hold_run_dir
    from .._distributed._stalled import StallWatch

    child_env = dict(os.environ if env is None else env)
    child_env.update(plan.env)
    torchrun = torchrun_command(plan, script, script_args, passthrough)
    if not trainer and plan.batch_sizes is not None:  # a user's script, told the sizes
        torchrun = _watching_first_step(torchrun, len(script_args))
    for key, value in interface_env(torchrun).items():
        child_env.setdefault(key, value)  # the user's own choice of interface stays
    nodes = _fixed_nnodes((passthrough or {}).get("nnodes")) or 1
    if trainer:  # ranks in lockstep end together: a node that does not come is lost
        child_env[ENV_EXIT_WAIT] = str(EXIT_WAIT_S)
    elif nodes > 1:
        # A user's script on several machines: torchrun's own bound, but evendp's exit barrier
        # (torchrun's C++ one races the store's node closing it: a C++ stack on the others).
        child_env[ENV_EXIT_WAIT] = str(TORCHRUN_EXIT_BARRIER_S)
    escalate = ESCALATE_S if comm_timeout is None else comm_timeout + 60.0
    with contextlib.ExitStack() as stack:
        if run_dir is not None:
            lock = stack.enter_context(hold_run_dir(run_dir))
            child_env.update(lock_env(lock))
        folder = stack.enter_context(
            tempfile.TemporaryDirectory(prefix="evendp-outcome-", dir=run_files_dir())
        )  # this user's private folder: no one else can plant or read the outcome
        outcome = Path(folder) / "outcome.json"
        child_env[ENV_OUTCOME] = str(outcome)
        child_env[ENV_TORCHRUN_LOG] = str(Path(folder) / "torchrun.log")  # kept on a fault
        # torchrun's per-rank error files: here, not in a torchelastic_* folder left in /tmp.
        logs = ["--log-dir", str(Path(folder) / "torchrun")]
        cmd = [sys.executable, str(QUIET_TORCHRUN), *logs, *torchrun[len(_TORCHRUN_MODULE) + 1 :]]
        world = None if plan.batch_sizes is None else len(plan.batch_sizes)
        even = world is not None and world == plan.nproc_per_node * nodes
        watch = StallWatch(Path(folder), world, plan.nproc_per_node if even else None)
        began = functools.partial(training_began, outcome) if trainer else None
        code = run_forwarding_signals(
            cmd, child_env, watch=watch, escalate_s=escalate, training=began
        )
        if watch.fired:
            print(f"evendp: error: {watch.line(comm_timeout)}", file=sys.stderr, flush=True)
            return 1, None
        if code < 0:  # torchrun itself killed, and not through this launcher
            print(f"evendp: error: {agent_killed(-code)}", file=sys.stderr, flush=True)
            return 128 - code, None
        said = read_outcome(outcome)
        code = code if said is None else int(said["code"])
        told = sizes_were_read(outcome) or sizes_were_told(outcome)
        if code == 0 and plan.batch_sizes is not None and not told:
            print(
                f"evendp launch: warning: no rank read the batch sizes {plan.batch_sizes} set "
                f"in {ENV_BATCH_SIZES}, so the script ran with batch sizes of its own, not these. "
                "evendp's Trainer and UnevenTrainer read them by themselves; a loop of your own "
                "reads them with evendp.batch_sizes_from_env() (UnevenBatchSampler(data, "
                "evendp.batch_sizes_from_env())); Lightning and Accelerate with "
                "evendp.integrations' uneven_dataloader (docs/integrations.md)",
                file=sys.stderr,
                flush=True,
            )
        return code, said


def _watching_first_step(torchrun: list[str], script_args: int) -> list[str]:
    """``torchrun`` running the script through :mod:`evendp._distributed._first_step`, which
    tells a script that ignores the sizes at its first step.

    >>> cmd = ["python", "-m", "torch.distributed.run", "t.py", "--lr", "1"]
    >>> _watching_first_step(cmd, 2)[3:]
    ['-m', 'evendp._distributed._first_step', 't.py', '--lr', '1']
    """
    from .._distributed._first_step import MODULE

    at = len(torchrun) - 1 - script_args
    return [*torchrun[:at], "-m", MODULE, *torchrun[at:]]


def agent_killed(signum: int) -> str:
    """The line for a torchrun (this node's agent) killed by ``signum`` from outside.

    >>> agent_killed(9)[:60]
    "torchrun, this node's agent, was killed by SIGKILL: its rank"
    """
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    return (
        f"torchrun, this node's agent, was killed by {name}: its ranks got SIGTERM (evendp's "
        "stop after their step, saving, and the other nodes end with them)"
    )
