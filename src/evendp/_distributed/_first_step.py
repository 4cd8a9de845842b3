"""Under ``evendp launch``: a script that ignores the launcher's batch sizes is told at its first
optimizer step, with the port for what it trains with.

Each rank runs ``python -m evendp._distributed._first_step train.py ...``, which runs the script
as ``python train.py`` would (``runpy``, its folder first on ``sys.path``) with a global
optimizer-step hook set once it imports ``torch.optim``. At the process's first step, when
nothing read the sizes (:func:`~evendp._distributed._launch_notes.sizes_read_here`, or an
``UnevenBatchSampler`` built with them: a hook on its class notes them, so the sampler touches
nothing of the launcher's), rank 0 warns once, naming the port (:func:`port_for`, from the
calling frames). Under ``EVENDP_STRICT=1`` (``--strict``) it is an error: the ranks agree in
one all-reduce (a decision that ends ranks is never local), every rank leaves at that step and
the launcher exits 2. evendp's own steps (:func:`evendp_steps`: a plan calibrating on live
GPUs) and steps on fake tensors (the planner measuring one) are not the script's.

On several machines (issue 51) the wrapper also wraps ``torch.distributed.init_process_group``:
once the script's group starts, the ranks run
:func:`~evendp._distributed._plan_agreement.agreed_plan` on the launcher's plan and the options
every machine must share (:data:`ENV_LAUNCH_OPTIONS`); a difference ends every rank there, each
machine's first rank saying it in one line, as under ``evendp train``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import runpy
import sys
from collections.abc import Callable, Iterator, Mapping
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any

from ._launch_notes import note_sizes_read, note_sizes_told, sizes_read_here, write_outcome

if TYPE_CHECKING:
    from .._core._errors import EvendpError

__all__ = [
    "ENV_LAUNCH_OPTIONS",
    "ENV_STRICT",
    "MODULE",
    "evendp_steps",
    "observed",
    "port_for",
    "unported_line",
]

#: The worker's entry point, as torchrun's ``-m`` names it.
MODULE = __name__
#: Set to ``1`` by ``evendp launch --strict``: an unported script is an error at its first step.
ENV_STRICT = "EVENDP_STRICT"
#: Set by ``evendp launch --nnodes N`` (N > 1): the options every machine must share, as JSON.
ENV_LAUNCH_OPTIONS = "EVENDP_LAUNCH_OPTIONS"
#: What each machine may give its own, named in the error.
_LAUNCH_OWN = "--node-rank, --nproc, --gpus, --min-free and the rendezvous address"
#: The per-rank sizes of every ``UnevenBatchSampler`` this launched process built, noted by
#: the hook the wrapper installs (:func:`observed`); in memory only, the launcher's alone.
_SAMPLED: set[tuple[int, ...]] = set()
#: How many :func:`evendp_steps` blocks are open: their optimizer steps are not the script's.
_held = 0

# What a script trains with, told by the modules of the frames that call optimizer.step()
# (a package, or a module and those below it), the most specific first: the port that makes
# it use the launcher's sizes. evendp's own Trainer and UnevenTrainer read the sizes
# themselves: only sizes given beside the launcher's could have kept them from it.
_PORTS = (
    ("evendp._training", "evendp's Trainer",
     "it takes the launcher's sizes itself under a strategy for ranks: drop "
     "TrainConfig(batch_sizes=...) and strategy='dp'"),
    ("evendp.integrations.transformers", "evendp's UnevenTrainer",
     "it takes the launcher's sizes itself: drop its batch_sizes= argument"),
    ("transformers", "an HF Trainer",
     "train with evendp.integrations.transformers.UnevenTrainer in its place"),
    ("lightning pytorch_lightning", "a Lightning Trainer",
     "return evendp.integrations.lightning.uneven_dataloader(...) from train_dataloader and "
     "add the UnevenGradient callback"),
    ("accelerate", "an Accelerate loop",
     "use UnevenAccelerator and uneven_dataloader from evendp.integrations.accelerate"),
    ("deepspeed", "a DeepSpeed engine",
     "build its loader from evendp.UnevenBatchSampler(data, evendp.batch_sizes_from_env()) "
     "and its micro-batch with evendp.config_micro_batch"),
)  # fmt: skip
_OWN_LOOP = (
    "its own loop",
    "sample with evendp.UnevenBatchSampler(data, evendp.batch_sizes_from_env()) and weigh "
    "the loss with evendp.ddp_loss (docs/ddp.md)",
)


def port_for(modules: list[str]) -> tuple[str, str]:
    """What a step called from ``modules`` (the calling frames' module names) trains with,
    and its port.

    >>> port_for(["torch.optim.sgd", "accelerate.optimizer", "transformers.trainer"])[0]
    'an HF Trainer'
    >>> port_for(["torch.optim.sgd", "__main__"])[0]
    'its own loop'
    >>> port_for(["pytorch_lightning.loops"])[0]
    'a Lightning Trainer'
    >>> port_for(["torch.optim.adamw", "evendp._training._step", "__main__",
    ...           "evendp._distributed._first_step"])[0]
    "evendp's Trainer"
    """

    def calls(name: str) -> bool:
        return any(m == name or m.startswith(name + ".") for m in modules)

    found = ((what, fix) for names, what, fix in _PORTS if any(map(calls, names.split())))
    return next(found, _OWN_LOOP)


def unported_line(sizes: str, port: tuple[str, str]) -> str:
    """What rank 0 says at the first step of a script that never read ``sizes``
    (``EVENDP_BATCH_SIZES``' text).

    >>> unported_line("1,3;caps=2,4", ("its own loop", "sample with ..."))[49:81]
    'reading the batch sizes [1, 3] ('
    """
    shown = "[" + sizes.split(";")[0].replace(",", ", ") + "]"
    return (
        f"the script took its first optimizer step without reading the batch sizes {shown} "
        f"(EVENDP_BATCH_SIZES), so its ranks train with sizes of its own; it trains with "
        f"{port[0]}: port it, {port[1]}"
    )


@contextlib.contextmanager
def evendp_steps() -> Iterator[None]:
    """Optimizer steps taken inside are evendp's own (a plan calibrating on live GPUs), not
    the script's first: the hook lets them pass. Outside a launch, nothing."""
    global _held
    _held += 1
    try:
        yield
    finally:
        _held -= 1


def _calling_modules(frame: FrameType | None) -> list[str]:
    names = []
    while frame is not None:
        names.append(str(frame.f_globals.get("__name__", "")))
        frame = frame.f_back
    return names


def observed(init: Callable[..., None]) -> Callable[..., None]:
    """``UnevenBatchSampler.__init__`` that also notes the sizes the sampler was built with:
    the hook the wrapper installs, so the sampler itself keeps no record for the launcher.
    """

    @functools.wraps(init)
    def init_and_note(sampler: Any, *args: Any, **kwargs: Any) -> None:
        init(sampler, *args, **kwargs)
        _SAMPLED.add(tuple(sampler.batch_sizes))

    return init_and_note


def _observe_samplers(module: ModuleType) -> None:
    sampler = module.UnevenBatchSampler
    sampler.__init__ = observed(sampler.__init__)


def _read_through_a_sampler() -> bool:
    """Whether this process read the launcher's sizes, or built an ``UnevenBatchSampler``
    with them however it parsed them (then it is marked read for the launcher)."""
    if sizes_read_here():
        return True
    text = os.environ.get("EVENDP_BATCH_SIZES", "")
    if not _SAMPLED or not text:
        return False
    from .._core._errors import EvendpError
    from ._batch_plan import BatchPlan

    try:
        launched = tuple(BatchPlan.parse(text).sizes)
    except EvendpError:  # not ours to judge here: batch_sizes_from_env names a bad value
        return False
    if launched not in _SAMPLED:
        return False
    note_sizes_read()
    return True


def _agreed_unread(unread: bool) -> bool:
    """Whether any rank took its step unread (one all-reduce when a process group is up)."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return unread
    from ._group import comm_device

    flag = torch.tensor([int(unread)], device=comm_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _on_fake_tensors(optimizer: Any) -> bool:
    """Whether ``optimizer`` steps fake tensors: a planner measuring the step, training
    nothing (``evendp.plan`` takes one before a script can read the sizes)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return any(isinstance(p, FakeTensor) for g in optimizer.param_groups for p in g["params"])


class _FirstStep:
    """The global optimizer-step pre-hook: runs once, at the process's first step."""

    done = False

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Done, it stays registered: removing a hook while torch iterates over the global
        # hooks raised "OrderedDict mutated during iteration" beside a later one (MemTracker's).
        if self.done or _held or _on_fake_tensors(optimizer):
            return
        self.done = True
        strict = os.environ.get(ENV_STRICT) == "1"
        unread = not _read_through_a_sampler()
        if strict:  # it ends ranks: decided by every rank alike
            unread = _agreed_unread(unread)
        if not unread:
            return
        line = unported_line(
            os.environ.get("EVENDP_BATCH_SIZES", "?"), port_for(_calling_modules(sys._getframe(1)))
        )
        rank0 = os.environ.get("RANK", "0") == "0"
        if not strict:
            if rank0:
                print(f"evendp launch: warning: {line}; --strict makes this an error",
                      file=sys.stderr, flush=True)  # fmt: skip
                note_sizes_told()
            return
        if rank0:
            print(f"evendp launch: error: {line} (--strict)", file=sys.stderr, flush=True)
            note_sizes_told()
            write_outcome(2)
        sys.stdout.flush()
        os._exit(0)  # every rank at this step; the launcher exits with rank 0's code


def _register(module: ModuleType) -> None:
    module.register_optimizer_step_pre_hook(_FirstStep())


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Run ``then(module)`` right after ``name`` is imported (torch is not imported for a
    script that never trains)."""

    def __init__(self, name: str, then: Any) -> None:
        self.name, self.then = name, then
        self.loader: Any = None

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # the real finders now
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.loader.exec_module(module)
        self.then(module)


def _watch(name: str, then: Any) -> None:
    """``then(module)`` once the module ``name`` is imported: now, if it already is."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def _agree_when_the_group_starts() -> None:
    """Have the ranks agree once the script's process group starts, when the launcher asked."""
    text = os.environ.get(ENV_LAUNCH_OPTIONS)
    if not text:
        return
    options = json.loads(text)  # the launcher's own JSON, through the ranks' environment
    if not isinstance(options, dict):
        return
    _watch("torch.distributed", functools.partial(_wrap_init, options=options))


def _wrap_init(module: Any, *, options: Mapping[str, Any]) -> None:
    """``init_process_group`` (the package's and ``distributed_c10d``'s), then the agreement."""
    original = getattr(module, "init_process_group", None)
    if original is None or getattr(original, "_evendp_agrees", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        started = original(*args, **kwargs)
        _agree(options)
        return started

    init_process_group._evendp_agrees = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group
    c10d: Any = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None:
        c10d.init_process_group = init_process_group


def _agree(options: Mapping[str, Any]) -> None:
    import torch.distributed as dist

    from .._core._errors import EvendpError
    from ._batch_plan import BatchPlan
    from ._plan_agreement import agreed_plan

    world = dist.get_world_size()

    def plan() -> BatchPlan:
        held = BatchPlan.from_env(world)  # not a read by the script: no mark for the launcher
        if held is None:
            raise EvendpError("EVENDP_BATCH_SIZES is not set on this machine's ranks")
        return held

    try:
        agreed_plan(plan, world, options, own=_LAUNCH_OWN)
    except EvendpError as exc:  # on every rank alike
        _end_on(exc)


def _end_on(error: EvendpError) -> None:
    """End this rank on ``error`` in one line, without a traceback (each machine's first rank
    says it and leaves the exit code for its launcher). Raised on every rank alike, exit 0
    (torchrun neither restarts nor reports); on this rank alone, exit 1, so that torchrun
    stops the ranks that would wait for it."""
    every = bool(error.every_rank)
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    if first or not every:
        where = "" if every else f"rank {os.environ.get('RANK', '?')}: "
        print(f"evendp launch: error: {where}{error}", file=sys.stderr, flush=True)
        write_outcome(error.exit_code, message=str(error))
    sys.stdout.flush()
    os._exit(0 if every else 1)


def main(argv: list[str]) -> None:
    """Run the script ``argv[0]`` with arguments ``argv[1:]`` as ``python script`` would.

    On several machines the ranks also agree on the launcher's plan once the script starts
    its process group. An :class:`~evendp.EvendpError` that escapes the script (bad input: a
    config that contradicts the launcher's sizes) is said in one line, not one traceback per
    rank (:func:`_end_on`).
    """
    from .._core._errors import EvendpError

    script, *args = argv
    _watch("torch.optim.optimizer", _register)
    _watch("evendp._distributed._sampler", _observe_samplers)
    _agree_when_the_group_starts()
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except EvendpError as error:
        _read_through_a_sampler()
        _end_on(error)
    finally:  # a script that never stepped may still have sampled with the sizes
        _read_through_a_sampler()


if __name__ == "__main__":
    # Run as the module evendp imports, not as a copy named __main__: evendp_steps, entered
    # by evendp's own code, must hold back the hook this process registered.
    from evendp._distributed._first_step import main as _main

    _main(sys.argv[1:])
