"""``evendp train``: train the built-in char-level GPT on the Python standard library's source.

With no arguments it uses every GPU (split by the planner or by free memory), or, with none,
three CPU virtual devices with an uneven split (weights 2,1,1), and writes a report (table,
JSON, PNG) and checkpoints to ``runs/demo``. ``--mode ddp`` starts one process per device
under torchrun (through ``evendp launch``'s planning). Exit code 2 on bad input, 130 after
SIGINT (Ctrl-C) and 143 after SIGTERM: the step in progress finishes on every rank, a
checkpoint is saved, and ``--resume`` continues. ``--max-restarts N`` (ddp/fsdp2) lets
torchrun restart the ranks after one dies; the restarted ranks resume from the last checkpoint.
"""

from __future__ import annotations

# Absolute imports: under --mode ddp this file is also torchrun's script.
import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

from evendp._errors import EvendpError

__all__ = ["add_parser", "run"]

_DEFAULT_OUT = "runs/demo"


def add_parser(subparsers: Any) -> None:
    """Register ``evendp train``."""
    p = subparsers.add_parser(
        "train",
        help="train the built-in char GPT on the stdlib source, using every device fully",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    p.add_argument("--batch", type=int, default=32, help="global batch per step (default 32)")
    p.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices, repeats are virtual devices, e.g. 'cpu,cpu,cpu' or "
        "'0,1' (default: all GPUs, else cpu,cpu,cpu)",
    )
    p.add_argument(
        "--weights",
        default=None,
        help="per-device split weights, e.g. '2,1,1' (default: 2,1,1 on CPU, free memory on GPUs)",
    )
    p.add_argument(
        "--mode",
        choices=("dp", "ddp", "fsdp2"),
        default="dp",
        help="dp: one process, BalancedDataParallel; ddp / fsdp2: one process per device under "
        "torchrun (fsdp2 checkpoints are sharded, in OUT/ckpt.dcp)",
    )
    p.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (default 1)")
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
        "--max-restarts",
        type=int,
        default=0,
        help="ddp/fsdp2: times torchrun restarts the ranks after one fails; they resume from "
        "the last checkpoint (default 0)",
    )
    p.add_argument(
        "--checkpoint-every", type=int, default=50, help="steps between checkpoints (0: end only)"
    )
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--n-embd", type=int, default=96)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-chars", type=int, default=1_000_000, help="corpus size in characters")
    p.add_argument("--no-plan", action="store_true", help="skip the planned-memory figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _validate_args(args: argparse.Namespace) -> None:
    for name in ("steps", "batch", "accum", "n_layer", "n_embd", "block_size", "max_chars"):
        value = getattr(args, name)
        if value < 1:
            flag = "--" + name.replace("_", "-")
            raise EvendpError(f"{flag} must be a positive int, got {value}; e.g. {flag} 2")
    if args.checkpoint_every < 0:
        raise EvendpError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.max_restarts < 0:
        raise EvendpError(f"--max-restarts must be >= 0, got {args.max_restarts}; e.g. 1")
    if args.max_restarts and args.mode == "dp":
        raise EvendpError(
            "--max-restarts restarts torchrun's ranks; use it with --mode ddp or fsdp2"
        )


_INTERRUPTED = ".interrupted"  # in OUT: rank 0 leaves the signal's number for the launcher


def _checkpoint_in(args: argparse.Namespace) -> Path:
    return Path(args.out) / ("ckpt.dcp" if args.mode == "fsdp2" else "ckpt.pt")


def _restarted() -> bool:
    """Whether torchrun restarted this rank after a failure (then it resumes implicitly)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0


def _resume_check(args: argparse.Namespace) -> int | None:
    """Before any work: an exit code when there is nothing to do, else ``None``.

    ``--resume`` with no checkpoint is an error (exit 2) unless ``--resume-or-start``; a
    checkpoint already at or past ``--steps`` is said and left untouched (exit 0).
    """
    from evendp._checkpoint import checkpoint_step, latest_checkpoint

    if not (args.resume or args.resume_or_start or _restarted()):
        return None
    found = latest_checkpoint(_checkpoint_in(args))
    if found is None:
        if args.resume and not args.resume_or_start:
            raise EvendpError(
                f"--resume: no checkpoint in {args.out!r} ({_checkpoint_in(args).name} or its "
                "previous copy); check --out and --mode, or pass --resume-or-start to start "
                "fresh when there is none"
            )
        return None
    step = checkpoint_step(found)
    if step >= args.steps:
        if os.environ.get("RANK", "0") == "0":
            print(
                f"evendp train: the checkpoint {str(found)!r} is at step {step}, at or past "
                f"--steps {args.steps}: nothing to train; raise --steps to continue (nothing "
                "was changed)",
                file=sys.stderr,
            )
        return 0
    return None


def _parse_devices(text: str | None) -> list[str | int]:
    if text is None:
        if torch.cuda.is_available():
            return list(range(torch.cuda.device_count()))
        return ["cpu", "cpu", "cpu"]
    out: list[str | int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise EvendpError(f"--devices {text!r} has an empty entry; e.g. --devices cpu,cpu")
        out.append(int(part) if part.isdigit() else part)
    return out


def _parse_weights(text: str | None, devices: list[str | int]) -> list[float] | None:
    if text is None:
        if all(str(d).startswith("cpu") for d in devices) and len(devices) == 3:
            return [2.0, 1.0, 1.0]  # virtual devices: show an uneven split
        if devices and all(isinstance(d, int) for d in devices):
            return _free_memory_weights([int(d) for d in devices])
        return None
    return _weights_list(text, len(devices))


def _weights_list(text: str, count: int) -> list[float]:
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise EvendpError(f"--weights {text!r} is not a list of numbers; e.g. 2,1,1") from None
    if len(weights) != count:
        raise EvendpError(
            f"--weights has {len(weights)} numbers for {count} devices; give one each"
        )
    return weights


def _free_memory_weights(ids: list[int]) -> list[float] | None:
    # Each GPU's share follows its free memory (another job on a card shrinks its share).
    free = []
    for i in ids:
        f, _ = torch.cuda.mem_get_info(i)
        free.append(float(f))
    return free if len(set(ids)) == len(ids) else None


def _build(args: argparse.Namespace) -> tuple[Any, Any, Any]:
    from evendp.examples.gpt import GPT, GPTConfig
    from evendp.examples.stdlib_text import stdlib_dataset

    train, _val, vocab = stdlib_dataset(block_size=args.block_size, max_chars=args.max_chars)
    n_head = 4 if args.n_embd % 4 == 0 else 1
    config = GPTConfig(
        vocab_size=vocab.size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=n_head,
        n_embd=args.n_embd,
    )
    torch.manual_seed(args.seed)
    return GPT(config), train, config


def _planned_peaks(config: Any, args: argparse.Namespace, ours: list[int]) -> tuple[Any, Any]:
    """Planned forward+backward peak per device, for our shares and for an even split.

    Not ``evendp.plan``: its ``DevicePlan.peak`` is for the planner's own split, and the
    shares here may come from ``--weights``; ``profile_step`` prices any share.
    """
    from evendp._plan import profile_step
    from evendp._split import split_sizes
    from evendp.cli._model_spec import _AMP, gpt_batch
    from evendp.examples.gpt import GPT

    even = split_sizes(args.batch, [1] * len(ours))
    sizes = sorted({n for n in [*ours, *even] if n > 0})
    prof = profile_step(
        lambda: GPT(config),
        gpt_batch(config),
        sizes,
        amp=_AMP[args.amp],
        checkpointing=args.checkpointing,
    )
    peak = dict(zip(prof["sizes"], prof["peak_bytes"], strict=True))
    # Device 0 also holds the optimizer state (DP keeps one optimizer, on the home device).
    extra = [int(prof["optimizer"]) if i == 0 else 0 for i in range(len(ours))]
    mine = [int(peak.get(n, 0)) + extra[i] for i, n in enumerate(ours)]
    theirs = [int(peak.get(n, 0)) + extra[i] for i, n in enumerate(even)]
    return mine, theirs


def _planner_weights(config: Any, args: argparse.Namespace, spec: str | None = None) -> Any:
    """The planner's per-device split of ``args.batch`` (``spec=None``: the live GPUs)."""
    from evendp._plan import plan
    from evendp.cli._model_spec import _AMP, gpt_batch
    from evendp.examples.gpt import GPT

    p = plan(
        lambda: GPT(config), gpt_batch(config), spec, mode="dp", batch_size=args.batch,
        amp=_AMP[args.amp], checkpointing=args.checkpointing,
    )  # fmt: skip
    return [float(n) for n in p.split]


def _print_exactness_check(trainer: Any, data: Any, batch_size: int) -> None:
    try:
        diff = _gradient_difference(trainer, data, batch_size)
    except torch.OutOfMemoryError:
        # On real GPUs the whole batch may not fit one device: that is why it is split.
        trainer.optimizer.zero_grad(set_to_none=True)
        print("evendp train: exactness check skipped: the whole batch does not fit one device")
        return
    print(
        f"evendp train: exactness check on the first batch: gradient over "
        f"{trainer.wrapped.last_sizes} vs one device on all {batch_size} samples: "
        f"relative difference {diff:.1e}",
        flush=True,
    )


def _gradient_difference(trainer: Any, data: Any, batch_size: int) -> float:
    """``||g_balanced - g_one|| / ||g_one||`` on the first batch: the split must not matter.

    ``g_balanced`` comes through BalancedDataParallel over every device with the uneven split;
    ``g_one`` from the same loss module on the whole batch on the home device. The gradients
    are cleared again afterwards, so training starts exactly as it would without the check.
    """
    from evendp._scatter import map_tensors

    home = trainer.wrapped.device_ids[0]
    batch = map_tensors(trainer._collate_indices(list(range(batch_size))), lambda t: t.to(home))
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def gradient(loss_module: Any) -> torch.Tensor:
        for p in params:
            p.grad = None
        loss_module(*batch).backward()
        return torch.cat([p.grad.flatten() for p in params if p.grad is not None])

    balanced = gradient(trainer.wrapped)
    one_device = gradient(trainer.wrapped.module)
    for p in params:
        p.grad = None
    return float((balanced - one_device).norm() / one_device.norm())


def _ddp_launch(args: argparse.Namespace) -> int:
    from evendp._interrupt import exit_code
    from evendp._launch import launch, plan_launch

    gpus, cpu = _ddp_devices(args.devices)
    nproc: int | str
    if args.devices is not None:
        nproc = len(gpus) if gpus else len(args.devices.split(","))
    else:
        nproc = "auto" if torch.cuda.is_available() else 2
    # cpu entries: CPU ranks (gloo) even on a GPU machine; NVML is not asked at all.
    where: dict[str, Any] = {"gpu_ids": gpus, "nvml": False} if cpu else {"gpu_ids": gpus}
    if args.weights is not None:  # uneven ranks: the weights fix every rank's batch size
        from evendp._split import split_sizes

        if nproc == "auto":
            raise EvendpError("--weights with --mode ddp needs --devices (one weight per rank)")
        weights = _weights_list(args.weights, int(nproc))
        plan = plan_launch(nproc=nproc, batch_sizes=split_sizes(args.batch, weights), **where)
    else:
        plan = plan_launch(nproc=nproc, batch=args.batch, **where)
    print(plan.describe(), file=sys.stderr, flush=True)
    argv = [
        "--mode", args.mode, "--steps", str(args.steps), "--batch", str(args.batch),
        "--amp", args.amp, "--accum", str(args.accum), "--out", args.out,
        "--checkpoint-every", str(args.checkpoint_every), "--lr", str(args.lr),
        "--seed", str(args.seed), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
        "--block-size", str(args.block_size), "--max-chars", str(args.max_chars),
    ]  # fmt: skip
    argv += [flag for flag, on in (("--resume", args.resume), ("--resume-or-start",
             args.resume_or_start), ("--checkpointing", args.checkpointing),
             ("--no-progress", args.no_progress)) if on]  # fmt: skip
    if cpu:  # the ranks must not pick up the GPUs they can see
        argv += ["--devices", args.devices]
    marker = Path(args.out) / _INTERRUPTED
    marker.unlink(missing_ok=True)
    # torchrun's --max-restarts only when asked (its default, 0, otherwise), with its c10d
    # rendezvous (what --standalone uses): each restart is a fresh rendezvous round.
    restarts: dict[str, Any] = {}
    if args.max_restarts:
        from evendp._launch import _free_port

        endpoint = f"127.0.0.1:{_free_port()}"
        restarts["passthrough"] = {
            "max_restarts": args.max_restarts,
            "rdzv_backend": "c10d",
            "rdzv_endpoint": endpoint,
        }
    code = launch(str(Path(__file__).resolve()), argv, plan=plan, **restarts)
    if code == 0 and marker.exists():  # a rank was signalled: all saved and stopped
        code = exit_code(int(marker.read_text() or 0))
        marker.unlink(missing_ok=True)
    return code


def _ddp_devices(text: str | None) -> tuple[list[int] | None, bool]:
    """``--devices`` under ``--mode ddp``: (physical GPU indices or None, CPU ranks?).

    >>> _ddp_devices("2,3"), _ddp_devices("cuda:1"), _ddp_devices("cpu,cpu"), _ddp_devices(None)
    (([2, 3], False), ([1], False), (None, True), (None, False))
    """
    if text is None:
        return None, False
    entries = _parse_devices(text)
    if all(str(d).startswith("cpu") for d in entries):
        return None, True
    gpus = []
    for d in entries:
        index = d if isinstance(d, int) else str(d).removeprefix("cuda:")
        if isinstance(index, str) and not index.isdigit():
            raise EvendpError(
                f"--devices {text!r} mixes or misnames devices for --mode ddp; give GPU "
                "indices (e.g. 0,1 or cuda:0,cuda:1), one per rank, or cpu,cpu for CPU ranks"
            )
        gpus.append(int(index))
    return gpus, False


def _restart_store() -> dict[str, Any]:
    """Under torchrun's agent store: a key prefix of this restart round's own.

    The agent's store outlives the workers; without a prefix per round, a restarted rank can
    read the dead round's gloo addresses and wait forever in ``init_process_group``.
    """
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


def _run_ddp_rank(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    from evendp._distributed import finish_distributed, init_distributed
    from evendp._report import write_report
    from evendp._sampler import batch_sizes_from_env
    from evendp._split import split_sizes
    from evendp._trainer import TrainConfig, Trainer

    cpu_ranks = _ddp_devices(args.devices)[1] or not torch.cuda.is_available()
    device = init_distributed("gloo" if cpu_ranks else "nccl", **_restart_store())
    # No teardown on an error: the failed rank would wait forever in finish_distributed's
    # barrier, and torchrun stops every rank once one fails.
    world = dist.get_world_size()
    sizes = batch_sizes_from_env(world, default=split_sizes(args.batch, [1] * world))
    model, data, _config = _build(args)
    model = model.to(device)
    cfg = TrainConfig(
        steps=args.steps, batch_size=sum(sizes), batch_sizes=sizes, accum=args.accum,
        lr=args.lr, amp=args.amp, activation_checkpointing=args.checkpointing,
        strategy="fsdp2" if args.mode == "fsdp2" else "ddp", out_dir=args.out,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume or args.resume_or_start or _restarted(), seed=args.seed,
        progress=not args.no_progress,
    )  # fmt: skip
    report = Trainer(model, data, cfg).fit()
    rank = dist.get_rank()
    finish_distributed()
    if rank == 0:
        _print_report(report, write_report(report, args.out))
        if report.interrupted:
            (Path(args.out) / _INTERRUPTED).write_text(str(report.signal))
    # Exit 0 after a clean stop: a failure code would make torchrun restart the group
    # (--max-restarts); the launcher turns the marker into 130/143.
    return 0


def _print_report(report: Any, paths: dict[str, Path]) -> None:
    from rich.console import Console

    console = Console()
    console.print(report.table())
    console.print(report.summary())
    console.print(f"report: {paths['txt']}, {paths['png']}, {paths['json']}")


def run(args: argparse.Namespace) -> int:
    """Train and write the report; exit code 0, 2 for bad input, 130/143 after SIGINT/SIGTERM."""
    try:
        _validate_args(args)
        done = _resume_check(args)
        if done is not None:
            return done
        if args.mode in ("ddp", "fsdp2"):
            if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
                return _run_ddp_rank(args)
            return _ddp_launch(args)
        return _run_dp(args)
    except EvendpError as exc:
        print(f"evendp train: error: {exc}", file=sys.stderr)
        return 2


def _run_dp(args: argparse.Namespace) -> int:
    from evendp._interrupt import exit_code
    from evendp._report import write_report
    from evendp._trainer import TrainConfig, Trainer

    devices = _parse_devices(args.devices)
    weights = _parse_weights(args.weights, devices)
    if all(str(d).startswith("cpu") for d in devices) and len(devices) > 1:
        # Virtual devices are threads: one intra-op thread each keeps 2 cores from thrashing.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(devices)))
    model, data, config = _build(args)
    on_gpus = all(isinstance(d, int) for d in devices)
    if args.devices is None and args.weights is None and len(devices) > 1 and on_gpus:
        # All GPUs, no weights given: the planner's split (device 0 also holds the optimizer
        # and the gathered outputs), else free memory when the planner cannot place the batch.
        try:
            weights = _planner_weights(config, args)
        except EvendpError as exc:
            print(f"evendp train: planner split unavailable ({exc}); using free memory")
    home = devices[0]
    model = model.to(torch.device("cuda", home) if isinstance(home, int) else torch.device(home))
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch, accum=args.accum, lr=args.lr, amp=args.amp,
        activation_checkpointing=args.checkpointing, out_dir=args.out,
        checkpoint_every=args.checkpoint_every, resume=args.resume or args.resume_or_start,
        seed=args.seed, progress=not args.no_progress,
    )  # fmt: skip
    trainer = Trainer(model, data, cfg, device_ids=list(devices), weights=weights)
    print(
        f"evendp train: {len(devices)} device(s) {trainer.device_names}, global batch "
        f"{args.batch}, samples per device per step {trainer.wrapped.split(args.batch)}",  # type: ignore[operator]
        flush=True,
    )
    if args.amp == "none" and not (args.resume or args.resume_or_start):
        _print_exactness_check(trainer, data, args.batch)
    report = trainer.fit()
    if not args.no_plan:
        try:
            ours = [round(d.samples_per_step) for d in report.devices]
            mine, even = _planned_peaks(config, args, ours)
            for d, a, b in zip(report.devices, mine, even, strict=True):
                d.planned_bytes, d.even_planned_bytes = a, b
        except EvendpError as exc:  # the report is still useful without planned figures
            print(f"evendp train: planned memory unavailable: {exc}", file=sys.stderr)
    _print_report(report, write_report(report, args.out))
    return exit_code(report.signal)


if __name__ == "__main__":  # torchrun runs this file as the script of each rank
    from evendp.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
