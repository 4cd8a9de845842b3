"""``evendp train``'s options: their declaration, the checks across them, and what they name
(torch is imported only where a value needs it)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .._core import _defaults as defaults
from .._core._errors import EvendpError
from .._core._validate import json_data, shown
from .._training._strategies import STRATEGIES, rank_strategy_names
from ._args import add_int, bounded_float, memory_text

__all__ = [
    "train_config",
    "DEMO_MEMORY",
    "OPTIONS_ENV",
    "add_options",
    "all_cpu",
    "device_memory",
    "is_launched_rank",
    "options_from_env",
    "options_json",
    "parse_devices",
    "parse_weights",
    "resume_check",
    "validate_args",
    "weights_list",
]

#: Where ``evendp train --mode ddp|fsdp2`` hands its validated options to the ranks.
OPTIONS_ENV = "EVENDP_TRAIN_OPTIONS"

_DEFAULT_OUT = "runs/demo"
# The CPU demo's virtual devices: two roomy, one small (the seeds' story).
DEMO_MEMORY = "48MiB,48MiB,24MiB"


def add_options(p: argparse.ArgumentParser) -> None:
    """Declare ``evendp train``'s options on its parser ``p``."""
    add_int(p, "--steps", (1, 10_000_000, 200), defaults.STEPS, "optimizer steps")
    add_int(p, "--batch", (1, 1_000_000, 32), defaults.BATCH, "global batch per step, in samples")
    p.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices, repeats are virtual devices, e.g. 'cpu,cpu,cpu' or "
        "'0,1' (default: all GPUs, else cpu,cpu,cpu with --memory " + DEMO_MEMORY + ")",
    )
    p.add_argument(
        "--memory",
        default=None,
        type=memory_text("--memory"),
        help="each device's memory, e.g. '48MiB,48MiB,24MiB': the planner splits the batch to "
        "fit it; on CPU devices it is a budget the device enforces (default: the GPUs' free "
        "memory; " + DEMO_MEMORY + " for the CPU demo)",
    )
    p.add_argument(
        "--weights",
        default=None,
        help="per-device split weights instead of the planner's split, e.g. '2,1,1'",
    )
    p.add_argument(
        "--mode",
        choices=tuple(STRATEGIES),
        default="dp",
        help="; ".join(f"{e.name}: {e.summary}" for e in STRATEGIES.values())
        + " (default dp; every mode but dp runs under torchrun)",
    )
    p.add_argument(
        "--strategy-config",
        default=None,
        metavar="JSON",
        help="the --mode's own settings as a JSON file, for a mode that reads some "
        "(TrainConfig.strategy_config)",
    )
    p.add_argument(
        "--amp",
        choices=("none", "bf16", "fp16"),
        default="none",
        help="autocast to bf16 / fp16 (fp16 with loss scaling) (default none: fp32)",
    )
    add_int(p, "--accum", (1, 1024, 2), 1, "micro-batches per step")
    p.add_argument("--out", default=_DEFAULT_OUT, help=f"output folder (default {_DEFAULT_OUT})")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoint in OUT (an error when there is none)",
    )
    p.add_argument(
        "--resume-or-start",
        action="store_true",
        help="continue from the checkpoint in OUT if there is one, else start fresh",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start fresh in OUT even when it holds another run's checkpoint, deleting that "
        "checkpoint (without it such a run is refused)",
    )
    restarts = f"--mode {_rank_modes()}: times torchrun restarts the ranks after one fails"
    add_int(
        p, "--max-restarts", (0, 100, 1), 0, restarts + "; they resume from the last checkpoint"
    )
    # --devices is each machine's own (MACHINE_OPTIONS); --weights, like every other option,
    # must agree on every machine (the plans' agreement compares them).
    nodes = p.add_argument_group(
        f"several machines (ranks: --mode {_rank_modes()})",
        "the same command on every machine, each with its --node-rank and its own --devices "
        "(machines may hold different numbers); --weights (one weight per rank of the whole "
        "run, node 0's first) and every other option the same everywhere",
    )
    add_int(nodes, "--nnodes", (1, 100_000, 2), 1, "machines in the run")
    place = "this machine's place, 0 to --nnodes - 1 (node 0 runs torchrun's store)"
    add_int(nodes, "--node-rank", (0, 99_999, 1), None, place)
    reach = "node 0's address every node reaches (on a private network: docs/ddp.md)"
    nodes.add_argument("--master-addr", type=str, default=None, help=reach)
    port = "node 0's port for the store (default: torchrun's, 29500)"
    add_int(nodes, "--master-port", (1, 65_535, 29_501), None, port)
    p.add_argument(
        "--comm-timeout",
        type=bounded_float(
            "--comm-timeout",
            defaults.MIN_COMM_TIMEOUT_S,
            86_400,
            "600",
            low_inclusive=True,
        ),
        default=defaults.COMM_TIMEOUT_S,
        metavar="SECONDS",
        help=f"--mode {_rank_modes()}: how long a rank waits for the others in a collective "
        "once training runs; a rank silent for longer (hung, stopped) ends the run, naming it, "
        f"exit 1 (at least {defaults.MIN_COMM_TIMEOUT_S:g}; default {defaults.COMM_TIMEOUT_S:g})",
    )
    every, between = defaults.CHECKPOINT_EVERY, "steps between checkpoints (0: end only)"
    add_int(p, "--checkpoint-every", (0, 10_000_000, every), every, between)
    p.add_argument(
        "--lr",
        type=bounded_float("--lr", 0.0, 10.0, "3e-3"),
        default=defaults.LR,
        help=f"AdamW learning rate (default {defaults.rate_text(defaults.LR)})",
    )
    warmup = "steps of linear learning-rate warmup, then the constant rate (default 0: none)"
    add_int(p, "--warmup-steps", (0, 10_000_000, 100), 0, warmup)
    seed = "seed of the model's initialization and the batch order"
    add_int(p, "--seed", (0, 2**63 - 1, defaults.SEED), defaults.SEED, seed)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    add_int(p, "--n-layer", (1, 64, 3), 3, "transformer blocks")
    add_int(p, "--n-embd", (4, 4096, 64), 64, "embedding width, a multiple of 4 (4 heads)")
    cut = "longest sample in characters; longer paragraphs are cut"
    add_int(p, "--block-size", (8, 4096, 128), 128, cut)
    add_int(
        p, "--max-chars", (10_000, 100_000_000, 1_000_000), 1_000_000, "corpus size in characters"
    )
    p.add_argument(
        "--log-to",
        choices=("csv", "tensorboard"),
        default=None,
        help="also write one row per step (step, loss, lr, each measured device's peak) to "
        "OUT/metrics.csv or, through torch.utils.tensorboard (pip install tensorboard), to "
        "OUT/tensorboard",
    )
    p.add_argument(
        "--balance",
        choices=defaults.BALANCES,
        default="none",
        help=f"--mode {_rank_modes()}: 'speed' moves samples from slow ranks to fast ones at "
        "step boundaries, the same samples per step and the same gradient (default none)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="train your own model instead of the char GPT: 'package.module:factory' (or "
        "'path/file.py:factory') where factory() returns (model, dataset) or (model, dataset, "
        "loss_fn); a rehearsal on CPU virtual devices that enforce --memory as budgets, e.g. "
        "--memory 24MiB,12MiB (evendp.rehearse; --mode dp; the GPT's size options are unused)",
    )
    p.add_argument("--no-plan", action="store_true", help="skip the planned-memory figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _rank_modes(last: str = ", ") -> str:
    """The ``--mode`` values that run ranks (``last`` joins the last one).

    >>> _rank_modes(), _rank_modes(" or ")
    ('ddp, fsdp2, zero1, deepspeed', 'ddp, fsdp2, zero1 or deepspeed')
    """
    *first, final = rank_strategy_names()
    return ", ".join(first) + last + final if first else final


def validate_args(args: argparse.Namespace) -> None:
    """Checks across options (each option's own range is checked by its type)."""
    if args.n_embd % 4:
        raise EvendpError(
            f"--n-embd must be a multiple of 4 (the model has 4 heads), got {args.n_embd}; "
            "e.g. --n-embd 64"
        )
    if args.log_to == "tensorboard":
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise EvendpError(
                "--log-to tensorboard needs the tensorboard package, which is not installed; "
                "pip install tensorboard, or use --log-to csv"
            ) from None
    if args.model is not None and args.mode != "dp":
        raise EvendpError(
            f"--model {args.model!r} rehearses on CPU virtual devices in one process; use "
            "--mode dp (the default), or evendp.Trainer under torchrun for ranks"
        )
    if args.balance != "none" and args.mode == "dp":
        raise EvendpError(
            f"--balance {args.balance} balances ranks; use it with --mode {_rank_modes(' or ')} "
            "(one process splits by --weights)"
        )
    _validate_nodes(args)
    if args.max_restarts and args.mode == "dp":
        raise EvendpError(
            f"--max-restarts restarts torchrun's ranks; use it with --mode {_rank_modes(' or ')}"
        )
    config = args.strategy_config
    if config is not None and not STRATEGIES[args.mode].takes_config:
        takers = [n for n, e in STRATEGIES.items() if e.takes_config]
        raise EvendpError(
            f"--mode {args.mode} reads no --strategy-config (got {shown(config)}); drop it"
            + (f", or use --mode {'/'.join(takers)}" if takers else "")
        )
    if config is not None and not Path(config).is_file():
        raise EvendpError(
            f"--strategy-config {shown(config)} is not a file; pass the path of a JSON file "
            "with the mode's settings"
        )
    if config is not None:
        STRATEGIES[args.mode].check_config(config)
    _validate_rank_options(args)
    _validate_pairs(args)


def _validate_pairs(args: argparse.Namespace) -> None:
    if args.resume and args.resume_or_start:
        raise EvendpError(
            "--resume (a checkpoint must be there) and --resume-or-start (start fresh when "
            "there is none) contradict each other; give one"
        )
    if args.overwrite and (args.resume or args.resume_or_start):
        flag = "--resume" if args.resume else "--resume-or-start"
        raise EvendpError(
            f"--overwrite (start fresh, deleting OUT's checkpoint) and {flag} (continue it) "
            "contradict each other; give one"
        )
    if args.accum > args.batch:
        raise EvendpError(
            f"--accum {args.accum} is more micro-batches than the {args.batch} samples of "
            f"--batch {args.batch}; give --accum <= --batch, e.g. --accum {min(2, args.batch)}"
        )


def _validate_nodes(args: argparse.Namespace) -> None:
    """Several machines: ranks only, and each node told where node 0 is and which it is."""
    given = [f for f, v in (("--node-rank", args.node_rank), ("--master-addr", args.master_addr),
                            ("--master-port", args.master_port)) if v is not None]  # fmt: skip
    if args.nnodes == 1:
        if given:
            raise EvendpError(
                f"{given[0]} places this machine among several, but --nnodes is 1; pass "
                "--nnodes N (the machines in the run), or drop it"
            )
        return
    if not STRATEGIES[args.mode].ranks:
        raise EvendpError(
            f"--nnodes {args.nnodes} runs ranks on several machines; use --mode "
            f"{_rank_modes(' or ')} (--mode {args.mode} is one process)"
        )
    if args.node_rank is None or args.master_addr is None:
        raise EvendpError(
            f"--nnodes {args.nnodes} needs --node-rank (this machine's place, 0 to "
            f"{args.nnodes - 1}) and --master-addr (node 0's address), the same command on "
            "every machine otherwise; e.g. --nnodes 2 --node-rank 0 --master-addr 10.0.0.1"
        )
    if args.node_rank >= args.nnodes:
        raise EvendpError(
            f"--node-rank {args.node_rank} is not one of the {args.nnodes} machines (0 to "
            f"{args.nnodes - 1}); e.g. --node-rank 0 on the machine at --master-addr"
        )
    if args.memory is not None:
        raise EvendpError(
            f"--memory plans this machine's ranks only, but --nnodes is {args.nnodes}; give "
            "--weights (one per rank of the whole run) or an even --batch"
        )


def _validate_rank_options(args: argparse.Namespace) -> None:
    if args.memory is not None and not STRATEGIES[args.mode].plans_memory:
        raise EvendpError(
            f"--memory {shown(args.memory)} plans DDP ranks' batch sizes, but the planner has no "
            f"memory model of sharded ranks (FSDP2, DeepSpeed ZeRO: --mode {args.mode}); use "
            "--mode ddp, or --weights to fix each rank's share"
        )
    if args.mode == "ddp" and args.memory is not None and args.weights is not None:
        raise EvendpError(
            f"--memory {shown(args.memory)} and --weights {shown(args.weights)} both set the "
            "ranks' batch sizes under --mode ddp (the planner's split for the memory, or the "
            "weights'); give one"
        )


def _checkpoint_in(args: argparse.Namespace) -> Path:
    return Path(args.out) / STRATEGIES[args.mode].checkpoint_name


def torchrun_restarted() -> bool:  # then the rank resumes implicitly
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def resume_check(args: argparse.Namespace) -> int | None:
    """Before any work: an exit code when there is nothing to do (a checkpoint at ``--steps``:
    0), else ``None``; ``--resume`` with no checkpoint is refused."""
    if not (args.resume or args.resume_or_start or torchrun_restarted()):
        return None
    node = int(getattr(args, "node_rank", 0) or 0)
    if node > 0 and not STRATEGIES[args.mode].checkpoint_spread:
        return None  # rank 0's checkpoint, on node 0: its launcher checks, its ranks send it
    from evendp._core._trusted import trusted_run_folder
    from evendp._training._checkpoint import resumable_checkpoint  # torch: only to resume

    trusted_run_folder(args.out)  # nothing is read from a folder another user controls
    # The checkpoint the resume will take: a corrupt latest one falls back to the previous.
    resumable = resumable_checkpoint(_checkpoint_in(args))
    if resumable is None:
        if args.resume and not args.resume_or_start:
            name = _checkpoint_in(args).name
            if node > 0:  # every rank wrote its part, on its own machine
                raise EvendpError(
                    f"--resume on node {node}: no checkpoint in {shown(args.out)} ({name} or "
                    f"its previous copy); under --mode {args.mode} every rank writes part of "
                    "it, so a run on several machines needs one --out that every machine "
                    "shares (a shared file system)"
                )
            raise EvendpError(
                f"--resume: no checkpoint in {shown(args.out)} ({name} or its "
                "previous copy); check --out and --mode, or pass --resume-or-start to start "
                "fresh when there is none"
            )
        return None
    found, step, extra = resumable
    saved_batch = extra.get("global_batch")
    if saved_batch is not None and int(saved_batch) != args.batch:  # refused before any work
        from evendp._core._errors import CheckpointError

        raise CheckpointError(
            f"checkpoint {shown(str(found))} was trained with a global batch of {saved_batch}, "
            f"this run has {args.batch}: resuming would change the order of the remaining samples; "
            f"resume with --batch {saved_batch}, or start fresh with another --out"
        )
    if step >= args.steps:
        if os.environ.get("RANK", "0") == "0":
            print(
                f"evendp train: the checkpoint {shown(str(found))} is at step {step}, at or past "
                f"--steps {args.steps}: nothing to train; raise --steps to continue (nothing "
                "was changed)",
                file=sys.stderr,
            )
        return 0
    return None


def fresh_start_check(args: argparse.Namespace) -> Callable[[], None] | None:
    """Before a fresh run's work: ``--out`` is writable and holds nothing of another run's
    (:mod:`evendp.cli._run_folder`); what undoes the claim if the run is then refused
    (``None``: nothing claimed). Ranks do not check: rank 0's first save would look like
    another run to a rank that starts late."""
    from ._run_folder import check_out_dir, claim_out_dir, unclaim_out_dir

    check_out_dir("--out", args.out)
    if args.resume or args.resume_or_start or torchrun_restarted() or is_launched_rank():
        return None
    created = not os.path.lexists(args.out)
    found = claim_out_dir(args.out, overwrite=args.overwrite)
    if found:  # said by the real folder's path: a link of the user's names another
        print(
            f"evendp train: --overwrite: deleted {len(found)} checkpoint file(s) in "
            f"{shown(str(found[0].parent))}: {', '.join(p.name for p in found)}"
        )
    return lambda: unclaim_out_dir(args.out, created=created)


#: Options named otherwise than the ``TrainConfig`` field they set (dest -> field).
_FIELD_OF = {"batch": "batch_size", "checkpointing": "activation_checkpointing", "out": "out_dir"}
#: Fields that only ranks take: in one process they would be refused or ignored.
_RANK_FIELDS = ("balance", "comm_timeout", "strategy_config")


def train_config(
    args: argparse.Namespace, *, every_step: bool, batch_sizes: list[int] | None = None
) -> Any:
    """The run's ``TrainConfig``, for one process or a rank (``batch_sizes``: its plan); an
    option named like its field is copied. ``every_step``: one log row per step."""
    import dataclasses

    from .._training._trainer import TrainConfig

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given = {_FIELD_OF.get(dest, dest): value for dest, value in vars(args).items()}
    fields = {name: value for name, value in given.items() if name in names}
    fields.update(
        progress=not args.no_progress,
        resume=args.resume or args.resume_or_start or torchrun_restarted(),
        log_every=1 if every_step else 10,
    )
    if batch_sizes is None:
        return TrainConfig(**{k: v for k, v in fields.items() if k not in _RANK_FIELDS})
    del fields["batch_size"]  # the ranks' sizes say it (their sum)
    return TrainConfig(**fields, batch_sizes=batch_sizes, strategy=args.mode)


def is_launched_rank() -> bool:
    return OPTIONS_ENV in os.environ and "RANK" in os.environ


def parse_devices(text: str | None, check_gpus: bool = True) -> list[str | int]:
    """``--devices`` as device ids (``check_gpus=False``: not checked against CUDA).

    >>> parse_devices("cpu, cpu")
    ['cpu', 'cpu']
    """
    if text is None:
        import torch

        if torch.cuda.is_available():
            return list(range(torch.cuda.device_count()))
        return ["cpu", "cpu", "cpu"]
    from evendp._planning._launch import MAX_NPROC

    if text.count(",") >= MAX_NPROC:  # each device is a replica (dp) or a rank process
        raise EvendpError(
            f"--devices {shown(text)} names {text.count(',') + 1} devices, more than "
            f"{MAX_NPROC} (the --nproc limit); e.g. --devices cpu,cpu,cpu"
        )
    out: list[str | int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise EvendpError(f"--devices {shown(text)} has an empty entry; e.g. --devices cpu,cpu")
        index = part.removeprefix("cuda:") if part.startswith("cuda:") else part
        if part == "cpu":
            out.append("cpu")
        elif index.isdigit():
            out.append(_validate_gpu(text, int(index)) if check_gpus else int(index))
        else:
            raise EvendpError(
                f"--devices {shown(text)}: {shown(part)} is not a device; write cpu, a GPU index "
                "(0) or cuda:0, e.g. --devices cpu,cpu,cpu"
            )
    return out


def _validate_gpu(text: str, index: int) -> int:
    import torch

    if not torch.cuda.is_available():
        raise EvendpError(
            f"--devices {shown(text)} names a GPU, but torch sees none here (no CUDA build or no "
            "driver); train on CPU virtual devices, e.g. --devices cpu,cpu,cpu"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise EvendpError(
            f"--devices {shown(text)}: GPU {index} does not exist, torch sees {count} "
            f"(0..{count - 1}); e.g. --devices 0"
        )
    return index


def device_memory(args: argparse.Namespace, devices: list[str | int]) -> list[int] | None:
    """Each device's memory in bytes (``None``: not declared, use weights or free memory)."""
    from ._model_spec import memory_specs

    text = args.memory
    if text is None and args.devices is None and args.weights is None and all_cpu(devices):
        text = DEMO_MEMORY  # the default demo: three virtual devices, one small
    if text is None:
        return None
    memory = [m.free for m in memory_specs(text)]
    if len(memory) != len(devices):
        raise EvendpError(
            f"--memory {shown(text)} has {len(memory)} entries for {len(devices)} devices; give "
            f"one each, e.g. --memory {','.join(['48MiB'] * len(devices))}"
        )
    return memory


def all_cpu(devices: list[str | int]) -> bool:
    return all(str(d).startswith("cpu") for d in devices)


def parse_weights(text: str | None, devices: list[str | int]) -> list[float] | None:
    if text is not None:
        return weights_list(text, len(devices))
    ids = [d for d in devices if isinstance(d, int)]
    if not devices or len(ids) < len(devices) or len(set(ids)) < len(ids):
        return None
    import torch  # each GPU's share follows its free memory (another job shrinks it)

    return [float(torch.cuda.mem_get_info(i)[0]) for i in ids]


def weights_list(text: str, count: int, nodes: int = 1) -> list[float]:
    """``--weights`` as numbers: one per device (``count``), or on ``nodes`` machines one per
    rank of the whole run (the ranks check the total)."""
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise EvendpError(f"--weights {shown(text)} is not a list of numbers; e.g. 2,1,1") from None
    if nodes == 1 and len(weights) != count:
        raise EvendpError(
            f"--weights has {len(weights)} numbers for {count} devices; give one each"
        )
    from .._planning._launch import least_run_ranks

    if len(weights) < least_run_ranks(count, nodes):
        raise EvendpError(
            f"--weights has {len(weights)} numbers, but this machine's {count} device(s) and "
            f"at least one on each of the other {nodes - 1} machine(s) need "
            f"{least_run_ranks(count, nodes)}; give one per rank of the whole run (node 0's "
            "first), the same list on every machine"
        )
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise EvendpError(
            f"--weights {shown(text)} must be numbers >= 0, not all 0; e.g. --weights 2,1,1"
        )
    return weights


def options_json(args: argparse.Namespace) -> str:
    """Every parsed option as JSON, for the ranks.

    >>> options_json(argparse.Namespace(steps=3, out="runs/x", func=print))
    '{"steps": 3, "out": "runs/x"}'
    """
    return json.dumps({k: v for k, v in vars(args).items() if k != "func"})


def options_from_env(args: argparse.Namespace) -> argparse.Namespace:
    """In a rank started by ``evendp train``: the launcher's options (``args`` elsewhere)."""
    if not is_launched_rank():
        return args
    return argparse.Namespace(**{**vars(args), **_checked_options(os.environ[OPTIONS_ENV])})


#: Options that are each machine's own in a run of several: the rest must agree everywhere.
MACHINE_OPTIONS = frozenset({"devices", "out", "node_rank", "no_progress", "overwrite"})


def run_options(args: argparse.Namespace) -> dict[str, Any]:
    """The options every machine of a run must share (the plans' agreement compares them).

    >>> run_options(argparse.Namespace(lr=0.1, out="runs/a", argv=["--lr", "0.1"], func=print))
    {'lr': 0.1}
    """
    skip = MACHINE_OPTIONS | set(_CONTEXT_KEYS) | {"func"}
    return {k: v for k, v in vars(args).items() if k not in skip}


# What options_json adds beside the options: the subcommand and the command line as typed.
_CONTEXT_KEYS = {"command": str, "argv": list}
_MAX_OPTIONS_CHARS = 1_000_000


def _checked_options(text: str) -> dict[str, object]:
    """``EVENDP_TRAIN_OPTIONS`` checked by the options' own argparse types and choices: a
    variable set by hand cannot pass what ``--n-layer 300`` would not.

    >>> _checked_options('{"n_layer": 300}')  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    evendp.InputError: EVENDP_TRAIN_OPTIONS: --n-layer must be an int in [1, 64], got '300'; ...
    """
    fix = (
        "it carries evendp train's options to its ranks: start the run with evendp train "
        f"--mode ddp|fsdp2, or unset {OPTIONS_ENV}"
    )
    if len(text) > _MAX_OPTIONS_CHARS:
        raise EvendpError(f"{OPTIONS_ENV} holds {len(text)} characters, not options; {fix}")
    try:
        given = json_data(text)
    except ValueError as exc:  # bad syntax, or nested too deep
        raise EvendpError(f"{OPTIONS_ENV}={shown(text)} is not JSON ({exc}); {fix}") from None
    if not isinstance(given, dict):
        raise EvendpError(f"{OPTIONS_ENV}={shown(text)} is not a JSON object; {fix}")
    parser = argparse.ArgumentParser(add_help=False)
    add_options(parser)
    actions = {a.dest: a for a in parser._actions}
    for key, value in given.items():
        action = actions.get(key)
        if action is None:
            kind = _CONTEXT_KEYS.get(key)
            if kind is None or not isinstance(value, kind):
                raise EvendpError(f"{OPTIONS_ENV} names an unknown option {shown(key)}; {fix}")
            continue
        problem = _option_problem(action, value)
        if problem is not None:
            raise EvendpError(f"{OPTIONS_ENV}: {problem}; {fix}")
    return given


def _option_problem(action: argparse.Action, value: object) -> str | None:
    """Why ``value`` is not what ``action``'s option takes on the command line, or ``None``."""
    flag = action.option_strings[0]
    if action.nargs == 0:  # a flag: store_true
        return None if isinstance(value, bool) else f"{flag} must be true or false"
    if value is None and action.default is None:
        return None
    if action.type is not None:
        # The value as the launcher wrote it: a number for a numeric option, the text itself
        # for a text-typed one (--memory), which its type returns unchanged.
        text = isinstance(value, str) and len(value) <= 4096
        if isinstance(value, bool) or not (text or isinstance(value, int | float)):
            return f"{flag} must be a number, got {shown(value)}"
        written = value if isinstance(value, str) else str(value)
        try:
            converted = action.type(written)  # type: ignore[operator]
        except argparse.ArgumentTypeError as exc:
            return str(exc)
        if text and converted != value:
            return f"{flag} must be a number, got {shown(value)}"
        return None
    if not isinstance(value, str) or len(value) > 4096:
        return f"{flag} must be text, got {shown(value)}"
    if action.choices is not None and value not in action.choices:
        return f"{flag} must be one of {tuple(action.choices)}, got {shown(value)}"
    return None
