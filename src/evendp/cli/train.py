"""``evendp train``: train the built-in char-level GPT on the Python standard library's source.

The data is variable-length: one paragraph of stdlib code per sample, padded to the longest in
the batch with -100 labels on the padding, and the loss is the exact mean over real
characters however the batch is split (count_fn counts them).

With no arguments it uses every GPU (split by the planner on their free memory), or, with
none, three CPU virtual devices that enforce memory budgets of 48MiB,48MiB,24MiB (the same as
--devices cpu,cpu,cpu --memory 48MiB,48MiB,24MiB): the planner splits the batch to fit them,
an even split (what nn.DataParallel runs) is tried first and runs out of memory on the small
device, and the report (table, JSON, PNG in runs/demo) shows both against the budgets.
A budget counts each replica's forward allocations plus its parameters (and, on the first
device, gradients and optimizer state); backward's transient allocations are not counted.

--mode ddp starts one process per device under torchrun (through evendp launch's planning).
Exit code 2 on bad input, 130 after SIGINT (Ctrl-C) and 143 after SIGTERM: the step in
progress finishes on every rank, a checkpoint is saved, and --resume continues.
--max-restarts N (ddp/fsdp2) lets torchrun restart the ranks after one dies; the restarted
ranks resume from the last checkpoint.
"""

from __future__ import annotations

# Absolute imports: under --mode ddp this file is also torchrun's script.
import argparse
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

from evendp._errors import EvendpError
from evendp._oom import is_oom_error
from evendp.cli._args import bounded_float, bounded_int, plain_text

__all__ = ["add_parser", "run"]

_DEFAULT_OUT = "runs/demo"
_DEFAULT_STEPS = 100
# The CPU demo's virtual devices: two roomy, one small (the seeds' story).
_DEMO_MEMORY = "48MiB,48MiB,24MiB"


def add_parser(subparsers: Any) -> None:
    """Register ``evendp train``."""
    p = subparsers.add_parser(
        "train",
        help="train the built-in char GPT on the stdlib source, using every device fully",
        description=plain_text(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--steps",
        type=bounded_int("--steps", 1, 10_000_000, 200),
        default=_DEFAULT_STEPS,
        help=f"optimizer steps (default {_DEFAULT_STEPS})",
    )
    p.add_argument(
        "--batch",
        type=bounded_int("--batch", 1, 1_000_000, 32),
        default=32,
        help="global batch per step, in samples (default 32)",
    )
    p.add_argument(
        "--devices",
        default=None,
        help="comma-separated devices, repeats are virtual devices, e.g. 'cpu,cpu,cpu' or "
        "'0,1' (default: all GPUs, else cpu,cpu,cpu with --memory " + _DEMO_MEMORY + ")",
    )
    p.add_argument(
        "--memory",
        default=None,
        help="each device's memory, e.g. '48MiB,48MiB,24MiB': the planner splits the batch to "
        "fit it; on CPU devices it is a budget the device enforces (default: the GPUs' free "
        "memory; " + _DEMO_MEMORY + " for the CPU demo)",
    )
    p.add_argument(
        "--weights",
        default=None,
        help="per-device split weights instead of the planner's split, e.g. '2,1,1'",
    )
    p.add_argument(
        "--mode",
        choices=("dp", "ddp", "fsdp2"),
        default="dp",
        help="dp: one process, BalancedDataParallel; ddp / fsdp2: one process per device under "
        "torchrun (fsdp2 checkpoints are sharded, in OUT/ckpt.dcp) (default dp)",
    )
    p.add_argument(
        "--amp",
        choices=("none", "bf16", "fp16"),
        default="none",
        help="autocast to bf16 / fp16 (fp16 with loss scaling) (default none: fp32)",
    )
    p.add_argument(
        "--accum",
        type=bounded_int("--accum", 1, 1024, 2),
        default=1,
        help="micro-batches per step (default 1)",
    )
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
        type=bounded_int("--max-restarts", 0, 100, 1),
        default=0,
        help="ddp/fsdp2: times torchrun restarts the ranks after one fails; they resume from "
        "the last checkpoint (default 0)",
    )
    p.add_argument(
        "--checkpoint-every",
        type=bounded_int("--checkpoint-every", 0, 10_000_000, 50),
        default=50,
        help="steps between checkpoints (0: end only) (default 50)",
    )
    p.add_argument(
        "--lr",
        type=bounded_float("--lr", 0.0, 10.0, "3e-3"),
        default=3e-3,
        help="AdamW learning rate (default 3e-3)",
    )
    p.add_argument(
        "--seed",
        type=bounded_int("--seed", 0, 2**63 - 1, 0),
        default=0,
        help="seed of the model's initialization and the batch order (default 0)",
    )
    p.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    p.add_argument(
        "--n-layer",
        type=bounded_int("--n-layer", 1, 64, 3),
        default=3,
        help="transformer blocks (default 3)",
    )
    p.add_argument(
        "--n-embd",
        type=bounded_int("--n-embd", 4, 4096, 64),
        default=64,
        help="embedding width, a multiple of 4 (4 heads) (default 64)",
    )
    p.add_argument(
        "--block-size",
        type=bounded_int("--block-size", 8, 4096, 128),
        default=128,
        help="longest sample in characters; longer paragraphs are cut (default 128)",
    )
    p.add_argument(
        "--max-chars",
        type=bounded_int("--max-chars", 10_000, 100_000_000, 1_000_000),
        default=1_000_000,
        help="corpus size in characters (default 1000000)",
    )
    p.add_argument(
        "--log-to",
        choices=("csv", "tensorboard"),
        default=None,
        help="also write one row per step (step, loss) to OUT/metrics.csv or, through "
        "torch.utils.tensorboard (pip install tensorboard), to OUT/tensorboard",
    )
    p.add_argument("--no-plan", action="store_true", help="skip the planned-memory figures")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _validate_args(args: argparse.Namespace) -> None:
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


def _parse_devices(text: str | None, check_gpus: bool = True) -> list[str | int]:
    """``--devices`` as BalancedDataParallel device ids; GPUs named only where CUDA is
    (``check_gpus=False``: physical ids for the launcher, which asks NVML itself).

    >>> _parse_devices("cpu, cpu")
    ['cpu', 'cpu']
    """
    if text is None:
        if torch.cuda.is_available():
            return list(range(torch.cuda.device_count()))
        return ["cpu", "cpu", "cpu"]
    out: list[str | int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            raise EvendpError(f"--devices {text!r} has an empty entry; e.g. --devices cpu,cpu")
        index = part.removeprefix("cuda:") if part.startswith("cuda:") else part
        if part == "cpu":
            out.append("cpu")
        elif index.isdigit():
            out.append(_validate_gpu(text, int(index)) if check_gpus else int(index))
        else:
            raise EvendpError(
                f"--devices {text!r}: {part!r} is not a device; write cpu, a GPU index "
                "(0) or cuda:0, e.g. --devices cpu,cpu,cpu"
            )
    return out


def _validate_gpu(text: str, index: int) -> int:
    if not torch.cuda.is_available():
        raise EvendpError(
            f"--devices {text!r} names a GPU, but torch sees none here (no CUDA build or no "
            "driver); train on CPU virtual devices, e.g. --devices cpu,cpu,cpu"
        )
    count = torch.cuda.device_count()
    if index >= count:
        raise EvendpError(
            f"--devices {text!r}: GPU {index} does not exist, torch sees {count} "
            f"(0..{count - 1}); e.g. --devices 0"
        )
    return index


def _memory(args: argparse.Namespace, devices: list[str | int]) -> list[int] | None:
    """Each device's memory in bytes (``None``: not declared, use weights or free memory)."""
    from evendp._memory import parse_memory

    text = args.memory
    if text is None and args.devices is None and args.weights is None and _all_cpu(devices):
        text = _DEMO_MEMORY  # the default demo: three virtual devices, one small
    if text is None:
        return None
    try:
        memory = [m.free for m in parse_memory(text)]
    except EvendpError as exc:
        raise EvendpError(f"--memory {text!r}: {exc}") from None
    if len(memory) != len(devices):
        raise EvendpError(
            f"--memory {text!r} has {len(memory)} entries for {len(devices)} devices; give "
            f"one each, e.g. --memory {','.join(['48MiB'] * len(devices))}"
        )
    return memory


def _all_cpu(devices: list[str | int]) -> bool:
    return all(str(d).startswith("cpu") for d in devices)


def _parse_weights(text: str | None, devices: list[str | int]) -> list[float] | None:
    if text is None:
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
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(weights):
        raise EvendpError(
            f"--weights {text!r} must be numbers >= 0, not all 0; e.g. --weights 2,1,1"
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
    """The model, the variable-length training paragraphs and the GPT config."""
    from evendp.examples.gpt import GPT, GPTConfig
    from evendp.examples.stdlib_text import stdlib_paragraphs

    train, _val, vocab = stdlib_paragraphs(block_size=args.block_size, max_chars=args.max_chars)
    if args.batch > len(train):
        raise EvendpError(
            f"--batch {args.batch} is more than the {len(train)} paragraphs in "
            f"--max-chars {args.max_chars}; lower --batch or raise --max-chars"
        )
    config = GPTConfig(
        vocab_size=vocab.size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=4,
        n_embd=args.n_embd,
    )
    torch.manual_seed(args.seed)
    return GPT(config), train, config


def _model_name(args: argparse.Namespace) -> str:
    return (
        f"char GPT {args.n_layer}x{args.n_embd} on stdlib paragraphs (<= {args.block_size} "
        "chars, padded)"
    )


def _planned_peaks(config: Any, args: argparse.Namespace, ours: list[int]) -> tuple[Any, Any]:
    """Planned forward+backward peak per device, for our shares and for an even split.

    Not ``evendp.plan``: its ``DevicePlan.peak`` is for the planner's own split, and the
    shares here may come from ``--weights``; ``profile_step`` prices any share (at the full
    ``block_size``: the longest a padded batch gets).
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


def _planner_weights(
    config: Any, args: argparse.Namespace, spec: str | list[int] | None = None, cpu: bool = False
) -> Any:
    """The planner's :class:`Plan` for ``args.batch`` (``spec=None``: the live GPUs).

    Declared memory on CPU devices gets no CUDA-context allowance: a CPU has no CUDA context.
    """
    from evendp._errors import PlanError
    from evendp._plan import plan
    from evendp.cli._model_spec import _AMP, gpt_batch
    from evendp.examples.gpt import GPT

    options: dict[str, Any] = {"cuda_context": 0} if cpu else {}
    try:
        p = plan(
            lambda: GPT(config), gpt_batch(config), spec, mode="dp", batch_size=args.batch,
            amp=_AMP[args.amp], checkpointing=args.checkpointing, **options,
        )  # fmt: skip
    except PlanError as exc:
        if not isinstance(spec, list):
            raise
        raise EvendpError(
            f"--batch {args.batch} does not fit --memory {args.memory or _DEMO_MEMORY} ({exc}); "
            "lower --batch, shrink the model (--n-layer, --n-embd, --block-size) or raise "
            "--memory"
        ) from None
    return p


def _first_batch(trainer: Any) -> Any:
    """The first training batch exactly as ``fit`` will draw it (shuffled, seeded)."""
    sampler = trainer.sampler
    sampler.set_epoch(0)
    indices = list(next(iter(sampler)))
    return trainer._collate_indices(indices)


def _print_exactness_check(trainer: Any, batch: Any) -> None:
    try:
        diff, count = _gradient_difference(trainer, batch)
    except (RuntimeError, ValueError) as exc:
        if not is_oom_error(exc):
            raise
        # The whole batch may not fit one device: that is why it is split.
        trainer.optimizer.zero_grad(set_to_none=True)
        print("evendp train: exactness check skipped: the whole batch does not fit one device")
        return
    print(
        f"evendp train: exactness check on the first (shuffled) batch: gradient over the split "
        f"{trainer.wrapped.last_sizes} vs one device on all {len(batch[0])} samples "
        f"({count} real characters, padding ignored): relative difference {diff:.1e}",
        flush=True,
    )


def _gradient_difference(trainer: Any, batch: Any) -> tuple[float, int]:
    """``||g_balanced - g_one|| / ||g_one||`` on a batch: the split must not matter.

    ``g_balanced`` comes through BalancedDataParallel over every device with the run's split
    and the token counts of each share; ``g_one`` from the model's own loss (the mean over the
    batch's real characters) on the home device. The gradients are cleared again afterwards,
    so training starts exactly as it would without the check.
    """
    from evendp._scatter import map_tensors
    from evendp.examples.stdlib_text import CodeParagraphs

    home = trainer.wrapped.device_ids[0]
    batch = map_tensors(batch, lambda t: t.to(home))
    count = int(CodeParagraphs.count_tokens(batch))
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def gradient(loss: Any) -> torch.Tensor:
        for p in params:
            p.grad = None
        loss().backward()
        return torch.cat([p.grad.flatten() for p in params if p.grad is not None])

    # The wrapper returns (sum over every real character) / rows: scale to the token mean.
    rows = len(batch[0])
    # A check of the arithmetic, not of memory: the budgets (if any) stay out of it.
    hook, trainer.wrapped._replica_context = trainer.wrapped._replica_context, None
    try:
        balanced = gradient(lambda: trainer.wrapped(*batch) * rows / count)
    finally:
        trainer.wrapped._replica_context = hook
    one_device = gradient(lambda: trainer.model(*batch)[1])
    for p in params:
        p.grad = None
    return float((balanced - one_device).norm() / one_device.norm()), count


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
    entries = _parse_devices(text, check_gpus=False)
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
    from evendp.examples.stdlib_text import CodeParagraphs

    # Each rank pads its own share to its longest paragraph: assigning the step's paragraphs
    # to ranks by length (costs=) cuts the padding and evens the ranks' work, with the same
    # samples per step and the same token-exact gradient (docs/balancing.md).
    trainer = Trainer(model, data, cfg, count_fn=CodeParagraphs.count_tokens, costs=data.lengths)
    report = trainer.fit()
    report.model = _model_name(args)
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
    if not console.is_terminal:  # a log file or pipe: wide enough for every column
        console = Console(width=130)
    console.print(report.table())
    console.print(report.summary())
    console.print("report: " + ", ".join(str(p) for p in paths.values()))


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
    except (RuntimeError, ValueError) as exc:
        if not is_oom_error(exc):
            raise
        print(
            f"evendp train: error: out of memory ({str(exc).splitlines()[0]}); lower --batch, "
            "shrink the model (--n-layer, --n-embd, --block-size), or declare --memory so the "
            "planner splits the batch to fit",
            file=sys.stderr,
        )
        return 2


def _run_dp(args: argparse.Namespace) -> int:
    from evendp._interrupt import exit_code
    from evendp._report import write_report
    from evendp._trainer import TrainConfig, Trainer
    from evendp.examples.stdlib_text import CodeParagraphs

    devices = _parse_devices(args.devices)
    memory = _memory(args, devices)
    weights = _parse_weights(args.weights, devices)
    if _all_cpu(devices) and len(devices) > 1:
        # Virtual devices are threads: one intra-op thread each keeps 2 cores from thrashing.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // len(devices)))
    model, data, config = _build(args)
    on_gpus = all(isinstance(d, int) for d in devices)
    planned = None
    if args.weights is None and memory is not None:
        # The split that fits the memory; a CPU has no CUDA context to allow for.
        planned = _planner_weights(config, args, memory, cpu=_all_cpu(devices))
        weights = [float(n) for n in planned.split]
    elif args.devices is None and args.weights is None and len(devices) > 1 and on_gpus:
        # All GPUs, no weights given: the planner's split (device 0 also holds the optimizer
        # and the gathered outputs), else free memory when the planner cannot place the batch.
        try:
            weights = [float(n) for n in _planner_weights(config, args).split]
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
    trainer = Trainer(
        model, data, cfg, device_ids=list(devices), weights=weights,
        count_fn=CodeParagraphs.count_tokens,
    )  # fmt: skip
    budgets = _attach_budgets(trainer, memory) if memory is not None and _all_cpu(devices) else None
    dp: Any = trainer.wrapped  # BalancedDataParallel in one process
    print(
        f"evendp train: {len(devices)} device(s) {trainer.device_names}, global batch "
        f"{args.batch}, samples per device per step {dp.split(args.batch)}"
        + ("" if memory is None else " (the planner's split for --memory " + _fmt(memory) + ")"),
        flush=True,
    )
    first = _first_batch(trainer)
    even = _even_split_probe(trainer, budgets, first) if budgets is not None else None
    if args.amp == "none" and not (args.resume or args.resume_or_start):
        _print_exactness_check(trainer, first)
    if budgets is not None:
        budgets.reset_peaks()  # the probes above are not part of training
    report = trainer.fit()
    report.model = _model_name(args)
    for i, d in enumerate(report.devices):
        if memory is not None:
            d.budget_bytes = memory[i]
        if budgets is not None:
            d.forward_peak_bytes = budgets.peaks[i]
        if even is not None:
            d.even_samples, d.even_forward_peak_bytes, d.even_oom = even[i]
    ours = [round(d.samples_per_step) for d in report.devices]
    even_shares = split_even(args.batch, len(ours))
    if planned is not None and planned.split == ours and planned.even_split == even_shares:
        for d, p in zip(report.devices, planned.devices, strict=True):  # planned already
            d.planned_bytes, d.even_planned_bytes = p.peak, p.even_peak
            d.even_samples = p.even_samples
    elif not args.no_plan:
        try:
            mine, theirs = _planned_peaks(config, args, ours)
            for d, a, b, n in zip(report.devices, mine, theirs, even_shares, strict=True):
                d.planned_bytes, d.even_planned_bytes = a, b
                d.even_samples = n
        except EvendpError as exc:  # the report is still useful without planned figures
            print(f"evendp train: planned memory unavailable: {exc}", file=sys.stderr)
    paths = write_report(report, args.out)
    if args.log_to is not None:
        paths["metrics"] = _log_metrics(report, args)
    _print_report(report, paths)
    if budgets is not None:
        print(_BUDGET_NOTE)
    return exit_code(report.signal)


_BUDGET_NOTE = (
    "Budgets on CPU virtual devices count each replica's forward allocations (activations "
    "kept for backward, temporaries, outputs) plus its parameters, and on the first device "
    "the gradients and optimizer state; backward's transient allocations run in the autograd "
    "engine's thread and are not counted (measured = forward peak; planned = the planner's "
    "forward+backward peak)."
)


def split_even(total: int, count: int) -> list[int]:
    from evendp._split import split_sizes

    return split_sizes(total, [1] * count)


def _fmt(memory: list[int]) -> str:
    from evendp._report import format_bytes

    return ",".join(format_bytes(m).replace(" ", "") for m in memory)


def _attach_budgets(trainer: Any, memory: list[int]) -> Any:
    """Make the virtual devices enforce ``memory``: resident bytes read live at every forward."""
    from evendp._budget import MemoryBudgets, tensor_bytes

    params = tensor_bytes(list(trainer.model.parameters()))

    def resident(i: int) -> int:
        if i:  # a replica: its copy of the parameters
            return params
        grads = [p.grad for p in trainer.model.parameters()]
        return params + tensor_bytes(grads) + tensor_bytes(list(trainer.optimizer.state.values()))

    return MemoryBudgets(memory, resident, names=trainer.device_names).attach(trainer.wrapped)


def _even_split_probe(trainer: Any, budgets: Any, batch: Any) -> list[tuple[int, int | None, bool]]:
    """One forward of ``batch`` split evenly, as nn.DataParallel would: does it fit?

    Returns per device ``(even share, measured forward peak, ran out)``; prints the outcome.
    """
    from evendp._scatter import map_tensors

    dp = trainer.wrapped
    even = split_even(len(batch[0]), len(dp.device_ids))
    batch = map_tensors(batch, lambda t: t.to(dp.device_ids[0]))
    budgets.reset_peaks()
    failed: int | None = None
    try:
        with dp.fixed_sizes(even):
            dp(*batch)
    except (RuntimeError, ValueError) as exc:
        if not is_oom_error(exc):
            raise
        failed = getattr(exc, "evendp_device_index", None)
        first_line = str(exc).splitlines()[0]
        print(
            f"evendp train: the even split {even} (what nn.DataParallel runs) fails: {first_line}"
        )
    else:
        print(f"evendp train: the even split {even} fits these budgets too")
    out = [(n, budgets.peaks[i], i == failed) for i, n in enumerate(even)]
    budgets.reset_peaks()
    return out


def _log_metrics(report: Any, args: argparse.Namespace) -> Path:
    """One row per step (step, loss) to OUT/metrics.csv or a TensorBoard event file."""
    out = Path(args.out)
    start = report.steps - len(report.losses) + 1
    if args.log_to == "csv":
        import csv

        path = out / "metrics.csv"
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["step", "loss"])
            for step, loss in enumerate(report.losses, start):
                writer.writerow([step, loss])
        return path
    from torch.utils.tensorboard import SummaryWriter

    path = out / "tensorboard"
    board = SummaryWriter(str(path))
    for step, loss in enumerate(report.losses, start):
        board.add_scalar("train/loss", loss, step)
    board.close()
    return path


if __name__ == "__main__":  # torchrun runs this file as the script of each rank
    from evendp.cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
