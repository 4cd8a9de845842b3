"""``evendp train --mode ddp|fsdp2``: the launcher plans the ranks and starts torchrun with
``cli/train.py`` as every rank's script; each rank trains its share, rank 0 reports."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from .._core import _defaults as defaults
from .._core._errors import EvendpError
from .._core._validate import shown
from ._args import say_error
from ._train_args import (
    OPTIONS_ENV,
    options_json,
    parse_devices,
    run_options,
    train_config,
    weights_list,
)
from ._train_common import build_demo, demo_model_name, metric_logger, print_report

__all__ = ["launch_ranks", "plan_ranks", "report_error", "run_rank", "say_how_to_resume"]


def report_error(exc: EvendpError) -> int:
    """One line for ``exc`` and its exit code; under torchrun each node's first rank says it
    and leaves the code to its launcher, and the rank exits 0 (no restart of a run that would
    fail again)."""
    from .._distributed._stalled import RankStalled, report_stalled
    from .._planning._launch import ENV_OUTCOME, write_outcome

    rank = os.environ.get("RANK")
    if rank is None or not os.environ.get(ENV_OUTCOME):
        say_error("evendp train", exc)
        return exc.exit_code
    if isinstance(exc, RankStalled):  # every answering rank reports; the launcher says it
        report_stalled(os.environ.get(ENV_OUTCOME), int(rank))
        # A collective stays stuck on the silent peer: Python's exit would wait on gloo's
        # threads and abort (SIGABRT, "terminate called ..."). Nothing is left to save.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if os.environ.get("LOCAL_RANK", rank) == "0":  # each node's first rank, for its launcher
        say_error("evendp train", exc)
        write_outcome(exc.exit_code, message=str(exc))
    return 0


def told_the_other_nodes(args: argparse.Namespace, exc: EvendpError) -> EvendpError:
    """``exc``, refusing the run on one machine of several, told to the other machines (which
    would otherwise wait until torchrun's rendezvous timeout), saying whether they were."""
    line = f"node {getattr(args, 'node_rank', 0)} refused the run: {exc}"
    said = _tell_the_other_nodes(args, line, exc.exit_code)
    if said is None:
        return exc
    told = EvendpError(f"{exc} ({said})")
    told.exit_code = exc.exit_code
    return told


def _tell_the_other_nodes(args: argparse.Namespace, line: str, code: int) -> str | None:
    """Leave ``line`` and ``code`` for the other machines; what became of it (``None``: one
    machine, or a rank, whose launcher tells them)."""
    from .._distributed._torchrun import _nodes

    nodes, node = int(getattr(args, "nnodes", 1) or 1), getattr(args, "node_rank", None)
    host = str(getattr(args, "master_addr", None) or "")
    if os.environ.get("RANK") is not None or nodes == 1 or node is None or not host:
        return None
    if not 0 <= int(node) < nodes or not _nodes.resolves(host):
        return None  # this machine's place, or node 0's address, is what it refused
    port = args.master_port or 29500  # in range: its option's type checked it
    where, wait = f"{host}:{port}", f"{_nodes.tell_wait_s():g} s"

    def waiting(what: str) -> None:
        print(
            f"evendp train: waiting up to {wait} for {what} that node {node} ended the run "
            "(Ctrl-C ends the wait)",
            file=sys.stderr,
            flush=True,
        )

    try:
        if node:
            told = _nodes.tell_node0(
                host, port, int(node), line, code=code,
                waiting=lambda: waiting(f"node 0 at {where} to come up, to tell it"),
            )  # fmt: skip
            if told:
                return f"node 0 at {where} was told, and stops too"
            return f"node 0 at {where} was not reached within {wait}: stop it there if it waits"
        missing = _nodes.tell_other_nodes(
            host, port, nodes, line, code=code, waiting=lambda: waiting("the other nodes to read")
        )
    except KeyboardInterrupt:
        return "the wait to tell the other nodes was interrupted: stop them there if they wait"
    if not missing:
        return "the other nodes were told, and stop too"
    names = ", ".join(map(str, missing))
    return f"node {names} did not come to {where} within {wait}: stop it there if it waits"


def told_nothing_to_train(args: argparse.Namespace, code: int) -> int:
    """On node 0 of several that found nothing to train: the other nodes are told to end."""
    if code == 0 and not getattr(args, "node_rank", None):
        _tell_the_other_nodes(args, "node 0 found nothing to train (its checkpoint is at "
                              "--steps)", 0)  # fmt: skip
    return code


def say_how_to_resume(code: int, argv: list[str] | None = None, saved: bool = True) -> int:
    """After a run stopped by a signal: the command that continues it (``saved``: the ranks
    said they saved)."""
    from .._distributed._interrupt import resume_command

    if code in (130, 143):
        command = resume_command(argv if argv is not None else sys.argv[1:])
        how = "stopped and saved" if saved else "stopped before saving (the last checkpoint stays)"
        print(f"evendp train: {how}; resume with: {command}", file=sys.stderr)
    return code


def launch_ranks(args: argparse.Namespace) -> int:
    """Plan the ranks, start them under torchrun and wait; the exit code."""
    from .._distributed._run_lock import child_env, hold_run_dir
    from .._planning._launch import launch_with_outcome

    plan, argv = plan_ranks(args)
    print(plan.describe(), file=sys.stderr, flush=True)
    script = str(Path(__file__).with_name("train.py").resolve())
    with hold_run_dir(args.out) as lock:  # held for the run's life; the ranks join it
        plan.env.update(child_env(lock))
        code, said = launch_with_outcome(  # rank 0 leaves the code, once it saved
            script,
            argv,
            plan=plan,
            comm_timeout=args.comm_timeout,
            trainer=True,
            **_restarts(args),
        )
    saved = said is not None and bool(said.get("interrupted"))
    return say_how_to_resume(code, args.argv, saved)


def plan_ranks(args: argparse.Namespace) -> tuple[Any, list[str]]:
    """The launch plan, carrying the options to the ranks as JSON (``OPTIONS_ENV``), and the
    ranks' argv, which only names the run (for ``ps`` and torchrun's logs)."""
    from .._planning._launch import plan_launch

    gpus, cpu = _ddp_devices(args.devices)
    nproc = _nproc(args, gpus)
    # cpu entries: CPU ranks (gloo) even on a GPU machine; NVML is not asked at all.
    where: dict[str, Any] = {"gpu_ids": gpus, "nvml": False} if cpu else {"gpu_ids": gpus}
    try:
        sizes = _rank_sizes(args, nproc, cpu)
        plan = plan_launch(nproc=nproc, nnodes=args.nnodes, **sizes, **where)
    except EvendpError:
        from . import has_gpu

        if gpus and not has_gpu():  # the launcher's words name its own --gpus
            raise EvendpError(
                f"--devices {shown(args.devices)} names GPUs, but no NVIDIA driver was found here; "
                "train on CPU ranks with --devices cpu,cpu"
            ) from None
        raise
    plan.env[OPTIONS_ENV] = options_json(args)
    argv = ["--mode", args.mode, "--out", args.out]
    if cpu:  # the ranks must not pick up the GPUs they can see
        argv += ["--devices", args.devices]
    return plan, argv


def _nproc(args: argparse.Namespace, gpus: list[int] | None) -> int | str:
    if args.devices is not None:
        return len(gpus) if gpus else len(args.devices.split(","))
    if args.memory is not None:  # one rank per declared memory
        return len(args.memory.split(","))
    import torch  # the launcher's only use: no --devices, no --memory

    return "auto" if torch.cuda.is_available() else 2


def _rank_sizes(args: argparse.Namespace, nproc: int | str, cpu: bool) -> dict[str, Any]:
    """``plan_launch``'s batch arguments: fixed by --weights, planned for --memory, or split."""
    if args.weights is not None:  # uneven ranks: the weights fix every rank's batch size
        from .._core._split import split_sizes

        if nproc == "auto":
            raise EvendpError("--weights with --mode ddp needs --devices (one weight per rank)")
        weights = weights_list(args.weights, int(nproc), args.nnodes)  # every node's ranks
        return {"batch_sizes": split_sizes(args.batch, weights)}
    if args.memory is None:
        return {"batch": args.batch}
    return _memory_sizes(args, nproc, cpu)


def _memory_sizes(args: argparse.Namespace, nproc: int | str, cpu: bool) -> dict[str, Any]:
    """The planner's DDP split of --batch over each rank's --memory (its budget)."""
    import torch

    from ..examples.gpt import GPT
    from ._model_spec import gpt_batch

    entries = len(args.memory.split(","))
    if nproc != "auto" and entries != nproc:
        raise EvendpError(
            f"--memory {shown(args.memory)} has {entries} entries for {nproc} ranks (--devices "
            f"{shown(args.devices)}); give one each, e.g. --memory "
            + ",".join(["48MiB"] * int(nproc))
        )
    _model, _data, config = build_demo(args)
    # CPU ranks have no CUDA context to allow for.
    options = {"amp": args.amp, "checkpointing": args.checkpointing}
    if cpu or not torch.cuda.is_available():
        options["cuda_context"] = 0
    return {
        "batch": args.batch,
        "model": lambda: GPT(config),
        "example_batch": gpt_batch(config),
        "memory": args.memory,
        "plan_options": options,
    }


def _restarts(args: argparse.Namespace) -> dict[str, Any]:
    """torchrun's --max-restarts when asked, and the nodes' options of several machines.

    The rendezvous stays torchrun's static one (each restart round reuses its store, under a
    prefix of its own: :func:`_restart_store`), not c10d's: its store listens on every
    interface and its agent unpickles what the store holds.
    """
    passed = {"max_restarts": args.max_restarts or None}
    if args.nnodes > 1:  # torchrun's static rendezvous at node 0 (docs/ddp.md)
        passed.update(
            nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
            master_port=args.master_port,
        )  # fmt: skip
    passed = {key: value for key, value in passed.items() if value is not None}
    return {"passthrough": passed} if passed else {}


def _ddp_devices(text: str | None) -> tuple[list[int] | None, bool]:
    """``--devices`` under ``--mode ddp``: (physical GPU indices or None, CPU ranks?).

    >>> _ddp_devices("2,3"), _ddp_devices("cuda:1"), _ddp_devices("cpu,cpu"), _ddp_devices(None)
    (([2, 3], False), ([1], False), (None, True), (None, False))
    """
    if text is None:
        return None, False
    entries = parse_devices(text, check_gpus=False)  # each "cpu" or a GPU index
    if all(d == "cpu" for d in entries):
        return None, True
    if "cpu" in entries:
        raise EvendpError(
            f"--devices {shown(text)} mixes or misnames devices for --mode ddp; give GPU "
            "indices (e.g. 0,1 or cuda:0,cuda:1), one per rank, or cpu,cpu for CPU ranks"
        )
    return [int(d) for d in entries], False


def _restart_store() -> dict[str, Any]:
    """Under torchrun's agent store, which outlives the workers: a key prefix of this restart
    round's own (else a restarted rank can read the dead round's addresses and hang)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    from datetime import timedelta

    import torch.distributed as dist

    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(minutes=10),
    )  # fmt: skip
    round_ = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {
        "store": dist.PrefixStore(f"evendp/round{round_}", agent),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }


def run_rank(args: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from .._distributed._group import finish_distributed, init_distributed
    from .._distributed._interrupt import die_with_parent, exit_code
    from .._distributed._plan_agreement import agreed_plan
    from .._planning._launch import write_outcome
    from .._planning._memory import parse_memory
    from .._training._trainer import Trainer

    die_with_parent()  # torchrun killed: this rank stops after its step, saving
    cpu_ranks = _ddp_devices(args.devices)[1] or not torch.cuda.is_available()
    device = init_distributed("gloo" if cpu_ranks else "nccl", **_restart_store())
    # No teardown on an error: the failed rank would wait forever in finish_distributed's
    # barrier, and torchrun stops every rank once one fails.
    world = dist.get_world_size()
    # Every rank builds the plan, then all agree: a rank whose plan is refused (machines that
    # started another number of ranks than the sizes name) stops every rank, not itself alone.
    plan = agreed_plan(lambda: _rank_plan(args, world), world, run_options(args))
    sizes = list(plan.sizes)
    model, data, _config = build_demo(args)
    model = model.to(device)
    logger = metric_logger(args)  # every rank has it (on_log is collective); rank 0 writes
    cfg = train_config(args, every_step=logger is not None, batch_sizes=sizes)
    from ..examples.stdlib_text import CodeParagraphs

    # Each rank pads its own share to its longest paragraph: assigning the step's paragraphs
    # to ranks by length (costs=) cuts the padding and evens the ranks' work, with the same
    # samples per step and the same token-exact gradient (docs/balancing.md). lengths are
    # also each paragraph's real targets (counts=): no all-reduce of the step's token count.
    trainer = Trainer(
        model, data, cfg, count_fn=CodeParagraphs.count_tokens, costs=data.lengths,
        counts=data.lengths, callbacks=None if logger is None else [logger[0]],
    )  # fmt: skip
    gc.freeze()  # what start-up built lives for the whole run: out of every later collection
    gc.enable()  # which train.py paused for start-up
    report = trainer.fit()
    report.model = demo_model_name(args)
    if args.memory is not None:  # each rank's declared --memory is its budget
        budgets = [m.free for m in parse_memory(args.memory)]
        if len(budgets) == len(report.devices):  # else more ranks than this node declared
            report.devices = [
                replace(d, budget_bytes=b) for d, b in zip(report.devices, budgets, strict=True)
            ]
    rank = dist.get_rank()
    del trainer, model  # their DDP wrapper holds the group: freed before the group ends
    finish_distributed()
    if rank == 0:
        print_report(report, args.out, logger)
        write_outcome(exit_code(report.signal), interrupted=report.interrupted)
    # Exit 0 after a clean stop: a failure code would make torchrun restart the group
    # (--max-restarts); the launcher exits with the code rank 0 left (130/143).
    return 0


def _rank_plan(args: argparse.Namespace, world: int) -> Any:
    """This run's batch plan: the launcher's ``EVENDP_BATCH_SIZES``, else ``--batch`` split
    evenly; a plan that sums to another global batch is refused."""
    from .._distributed._batch_plan import BatchPlan, global_batch_size
    from .._distributed._launch_notes import note_sizes_read

    launched = OPTIONS_ENV in os.environ  # by evendp train: the sizes came from its flags
    given = BatchPlan.from_env(environ={k: v for k, v in os.environ.items() if k != "WORLD_SIZE"})
    if launched and given is not None and len(given.sizes) != world:
        here = os.environ.get("LOCAL_WORLD_SIZE", "?")
        raise EvendpError(
            f"--weights (or an even --batch) gives {len(given.sizes)} ranks, but the machines "
            f"started {world} in all ({here} on this one, from --devices); give one weight per "
            "rank of the whole run, node 0's first, the same list on every machine"
        )
    plan = BatchPlan.from_env(world)
    if plan is None:
        return BatchPlan.even(args.batch, world)
    note_sizes_read()  # this rank trains with the launcher's sizes: it does not warn
    # evendp train --mode ddp planned the sizes for its --batch; under the user's own torchrun
    # a --batch other than the default was given, and must agree with the sizes set by hand.
    if launched or args.batch != defaults.BATCH:
        global_batch_size(args.batch, list(plan.sizes), cli="EVENDP_BATCH_SIZES=")
    return plan
