"""The training loop that composes evendp: one readable loop in the style of nanoGPT.

Each optimizer step takes one global batch (``batch_size`` samples). In one process the model
runs under :class:`BalancedDataParallel`, which splits every (micro-)batch across the devices
by their weights and returns the exact sample-weighted mean loss. Under ``torchrun`` each rank
runs its own share (``batch_sizes[rank]``, from :class:`UnevenBatchSampler`) and the gradient
is averaged over ranks with every micro-batch weighted by its samples over the global count.

Gradient accumulation and the OOM re-split are the same mechanism: the step runs as
micro-batches through :class:`OomResplit`, which halves them whenever one runs out of memory.
The gradient is that of the global batch's mean loss however the batch is cut. In one process
each device's share is cut by its own cap: an OOM in one replica's forward halves that
device's micro-batches only, and the healthy devices keep running their shares in one go.

Under DDP with ``oom_resplit=True`` (the default) every rank accumulates its gradients locally
and they are averaged in one all-reduce after all ranks agreed to step: an OOM in the middle of
one rank's backward would otherwise leave the others blocked inside DDP's bucket all-reduces.
The price is no overlap of communication with backward; ``oom_resplit=False`` gives plain DDP.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from ._checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    load_rank_rng,
    save_checkpoint,
    save_rank_rng,
)
from ._distributed import comm_device
from ._dp import BalancedDataParallel
from ._errors import EvendpError
from ._evaluate import EvalFn, evaluate_devices, evaluate_ranks, loss_eval_fn
from ._oom import OomResplit, all_reduce_gradients
from ._report import DeviceStat, TrainProgress, TrainReport, format_bytes
from ._sampler import EmptySafeCollate, UnevenBatchSampler
from ._scatter import batch_size, map_tensors, to_device
from ._split import split_sizes
from ._validate import validate_int

__all__ = ["TrainConfig", "Trainer", "default_loss"]

Batch = Any
LossFn = Callable[[nn.Module, Batch], torch.Tensor]
_AMP = ("none", "bf16", "fp16")


@dataclass
class TrainConfig:
    """Settings of a :class:`Trainer` run.

    ``batch_size`` is the global batch per optimizer step (in one process; under ``torchrun``
    the per-rank sizes come from ``batch_sizes``). ``accum`` splits each step into that many
    micro-batches (gradient accumulation); the gradient is unchanged.

    >>> TrainConfig(steps=10, amp="bf16").amp
    'bf16'
    """

    steps: int = 100
    batch_size: int = 32
    batch_sizes: list[int] | None = None  # per rank, under torchrun; None: even split
    accum: int = 1
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float | None = 1.0
    amp: Literal["none", "bf16", "fp16"] = "none"
    activation_checkpointing: bool = False
    oom_resplit: bool = True
    strategy: Literal["ddp", "fsdp2"] = "ddp"  # under torchrun
    out_dir: str | Path | None = None
    checkpoint_every: int = 0  # 0: only at the end and on Ctrl-C
    resume: bool = False
    seed: int = 0
    progress: bool = True
    eval_every: int = 0  # steps between evaluations of eval_data; 0: only after the last step

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "accum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise EvendpError(f"{name} must be a positive int, got {value!r}")
        if self.amp not in _AMP:
            raise EvendpError(f"amp must be one of {_AMP}, got {self.amp!r}; e.g. amp='bf16'")
        if self.checkpoint_every < 0:
            raise EvendpError(
                f"checkpoint_every must be >= 0 (0: only at the end), got {self.checkpoint_every}"
            )
        if (self.resume or self.checkpoint_every) and self.out_dir is None:
            raise EvendpError("resume and checkpoint_every need out_dir, where checkpoints live")
        if self.strategy not in ("ddp", "fsdp2"):
            raise EvendpError(f"strategy must be 'ddp' or 'fsdp2', got {self.strategy!r}")
        validate_int("eval_every", self.eval_every, minimum=0, example="eval_every=100")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise EvendpError(f"grad_clip must be positive or None, got {self.grad_clip!r}")


def default_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """``model(x, y)`` when it returns a scalar loss, or the loss of ``(logits, loss)``.

    >>> class NanoStyle(nn.Module):
    ...     def forward(self, x, y):
    ...         return x * 2, (x - y).abs().mean()
    >>> default_loss(NanoStyle(), (torch.ones(2), torch.zeros(2)))
    tensor(1.)
    """
    x, y = batch
    out = model(x, y)
    return out[1] if isinstance(out, tuple) else out


class _LossModule(nn.Module):
    """Runs ``loss_fn(model, batch)`` inside ``forward`` so each replica returns only its loss.

    BalancedDataParallel then combines the scalars exactly, and no logits are gathered.
    """

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *batch: Any) -> torch.Tensor:
        return self.loss_fn(self.model, batch)


def _keep_batchnorm_fp32(model: nn.Module) -> None:
    # Autocast never casts parameters, so BatchNorm weights and running statistics stay fp32;
    # feeding it fp32 inputs keeps its arithmetic (and the running stats' updates) in fp32 too.
    def to_fp32(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.register_forward_pre_hook(to_fp32)


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks: the children of every nn.ModuleList (e.g. transformer layers)."""
    return [m for lst in model.modules() if isinstance(lst, nn.ModuleList) for m in lst]


def _apply_activation_checkpointing(model: nn.Module) -> None:
    # Recompute each repeated block (the children of a ModuleList, e.g. transformer layers)
    # in backward instead of keeping its activations. The wrapper keeps state_dict keys.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    blocks = {id(m) for m in _blocks(model)}
    if not blocks:
        raise EvendpError(
            "activation_checkpointing found no nn.ModuleList of blocks in the model; "
            "hold the repeated layers in an nn.ModuleList or turn the option off"
        )
    apply_activation_checkpointing(model, check_fn=lambda m: id(m) in blocks)


def _rows(batch: Batch, ranges: list[tuple[int, int]]) -> Batch:
    """The samples ``[start, stop)`` of every range, in order: a view when they are adjacent.

    >>> _rows(torch.arange(6), [(0, 2), (3, 5)]), _rows(torch.arange(6), [(0, 2), (2, 4)])
    (tensor([0, 1, 3, 4]), tensor([0, 1, 2, 3]))
    """
    ranges = [(a, b) for a, b in ranges if b > a]
    if not ranges:  # an empty micro-step (a rank with no samples): zero rows, same layout
        return map_tensors(batch, lambda t: t[:0] if t.dim() else t)
    if all(prev[1] == nxt[0] for prev, nxt in itertools.pairwise(ranges)):
        start, stop = ranges[0][0], ranges[-1][1]
        return map_tensors(batch, lambda t: t[start:stop])
    index = torch.cat([torch.arange(a, b) for a, b in ranges])  # (samples,)
    return map_tensors(batch, lambda t: t[index.to(t.device)])


def _batch_len(batch: Batch) -> int:
    n = batch_size(batch)
    if n is None:
        raise EvendpError(
            f"cannot find the batch dimension of {type(batch).__name__}; return tensors with "
            "the samples along dim 0 from the dataset (or its batch(indices) method)"
        )
    return n


class Trainer:
    """Train ``model`` on ``data`` with balanced DP (one process) or uneven DDP (torchrun).

    Args:
        model: on ``devices[0]`` (one process) or on this rank's device (DDP).
        data: a map-style dataset; a ``batch(indices)`` method is used when present.
        config: a :class:`TrainConfig`.
        devices: one process: the device list for BalancedDataParallel (repeats are virtual
            devices). DDP: ignored (the model's device is used).
        weights: per-device weights for the split (``None``: even).
        loss_fn: ``loss_fn(model, batch) -> mean loss``; default :func:`default_loss`.
        optimizer, scheduler: default AdamW(lr, weight_decay) and none.
        eval_data: a map-style dataset evaluated every ``config.eval_every`` steps and after
            the last step (``eval_every=0``: only then), in order, every sample exactly once
            over all devices and ranks, under ``torch.no_grad`` with the model in eval mode.
            Results: ``TrainReport.eval``, the progress bar, ``report.json`` and the PNG.
        eval_fn: ``eval_fn(model, batch) -> {name: (sum, count)}``; each metric is
            ``total sum / total count``, exactly one device's over the whole set. Default:
            ``{"loss": (loss_fn's mean x count, count)}``, the count being the samples.

    >>> from evendp.examples.stdlib_text import CharWindows
    >>> torch.manual_seed(0) and None
    >>> data = CharWindows(torch.randint(0, 5, (200,)), block_size=4)
    >>> class Bigram(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = nn.Embedding(5, 5)
    ...     def forward(self, x, y):
    ...         return nn.functional.cross_entropy(self.emb(x).view(-1, 5), y.view(-1))
    >>> cfg = TrainConfig(steps=5, batch_size=12, lr=0.1, progress=False)
    >>> report = Trainer(Bigram(), data, cfg, devices=["cpu", "cpu"], weights=[2, 1]).fit()
    >>> report.steps, [d.samples_per_step for d in report.devices]
    (5, [8.0, 4.0])
    >>> report.final_loss < report.first_loss
    True
    """

    def __init__(
        self,
        model: nn.Module,
        data: Dataset[Any],
        config: TrainConfig,
        *,
        devices: list[str | int | torch.device] | None = None,
        weights: list[float] | None = None,
        loss_fn: LossFn = default_loss,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        eval_data: Dataset[Any] | None = None,
        eval_fn: EvalFn | None = None,
    ) -> None:
        self.config = config
        self.model = model
        self.data = data
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        self.device = next(model.parameters()).device
        if config.amp != "none":
            _keep_batchnorm_fp32(model)
        if config.activation_checkpointing:
            _apply_activation_checkpointing(model)
        # fp16 needs loss scaling so small gradients do not flush to zero; bf16 does not.
        self.scaler = torch.amp.GradScaler(self.device.type) if config.amp == "fp16" else None
        loss_module = _LossModule(model, loss_fn)
        if self.distributed:
            sizes = config.batch_sizes or split_sizes(config.batch_size, [1] * self.world)
            self.sampler = UnevenBatchSampler(
                data, sizes, rank=self.rank, world_size=self.world, seed=config.seed
            )
            self.wrapped: nn.Module = loss_module
            self.fsdp = config.strategy == "fsdp2"
            if self.fsdp:
                _validate_fsdp2(config, optimizer)
            if not config.oom_resplit and not self.fsdp:
                self.wrapped = nn.parallel.DistributedDataParallel(
                    loss_module, broadcast_buffers=False
                )
            else:
                for t in model.state_dict().values():  # start from rank 0's weights, as DDP does
                    dist.broadcast(t, src=0)
            if self.fsdp:
                _shard(model)
            self.device_names = [f"rank{r}" for r in range(self.world)]
        else:
            self.fsdp = False
            self.sampler = UnevenBatchSampler(
                data, [config.batch_size], rank=0, world_size=1, seed=config.seed
            )
            self.wrapped = BalancedDataParallel(loss_module, devices, weights=weights)
            self.dp_devices: list[torch.device] = list(self.wrapped.device_ids)
            self.device_names = [
                f"{d}:{i}" if d.index is None else str(d) for i, d in enumerate(self.dp_devices)
            ]
        # FSDP2 all-gathers parameters inside forward and backward: a retry on one rank would
        # mismatch the collectives, so there OOM is fatal (micro-batching still works).
        # One process: a micro-batch cap per device, so an OOM shrinks only the failing share.
        # Under torchrun each rank is one device of its own guard.
        # oom_resplit=False: an OOM propagates, as in plain PyTorch.
        self.guard = OomResplit(
            catch=config.oom_resplit and not (self.distributed and self.fsdp),
            devices=1 if self.distributed else len(self.device_names),
        )
        # Built after sharding: FSDP2 replaces the parameters with sharded ones.
        self.optimizer = optimizer or torch.optim.AdamW(
            model.parameters(), lr=config.lr, weight_decay=config.weight_decay
        )
        self.scheduler = scheduler
        # A dataset without batch(indices) is collated per sample; an empty share (a rank of
        # size 0, or the short last step) gives zero-length tensors rather than an IndexError.
        batch_fn = getattr(data, "batch", None)
        self._batch_fn: Callable[[list[int]], Batch] | None = (
            batch_fn if callable(batch_fn) else None
        )
        self._collate = EmptySafeCollate(data)
        self.samples = [0] * len(self.device_names)
        #: The last step's micro-steps: per micro-step, the samples each device ran.
        self.micro_steps: list[list[int]] = []
        self.losses: list[float] = []
        self.step = 0
        self.eval_data = eval_data
        self.eval_fn = eval_fn if eval_fn is not None else loss_eval_fn(loss_fn)
        #: Every evaluation so far: ``{"step": step, "metrics": {name: value}}``.
        self.evals: list[dict[str, Any]] = []
        self.epoch = 0
        self.batch_in_epoch = 0

    # -- checkpoints -------------------------------------------------------------------------

    @property
    def checkpoint_path(self) -> Path | None:
        """``out_dir/ckpt.pt`` (``None`` without an output directory)."""
        out = self.config.out_dir
        return None if out is None else Path(out) / "ckpt.pt"

    def save(self) -> Path | None:
        """Write a checkpoint now (rank 0; other ranks save their RNG); returns its path."""
        path = self.checkpoint_path
        if path is None:
            return None
        if self.rank != 0:  # the checkpoint is rank 0's; each other rank keeps its own RNG
            save_rank_rng(path, self.rank, self.step)
            return None
        return save_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            scheduler=self.scheduler,
            step=self.step,
            extra={
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "losses": self.losses,
                "samples": self.samples,
                "micro_batch_sizes": self.guard.micro_batch_sizes,
                "resplits": self.guard.resplits,
                "skipped": self.guard.skipped,
            },
        )

    def _resume(self) -> None:
        path = None if self.checkpoint_path is None else latest_checkpoint(self.checkpoint_path)
        if path is None:
            return  # nothing to resume from: a fresh start, as on the first run
        info = load_checkpoint(
            path,
            model=self.model,
            optimizer=self.optimizer,
            scaler=self.scaler,
            scheduler=self.scheduler,
        )
        extra = info["extra"]
        self.step = info["step"]
        if self.rank != 0:  # rank 0's generators were just restored; this rank's own, if saved
            load_rank_rng(path, self.rank, self.step)
        self.epoch = int(extra.get("epoch", 0))
        self.batch_in_epoch = int(extra.get("batch_in_epoch", 0))
        self.losses = [float(v) for v in extra.get("losses", [])]
        saved = [int(v) for v in extra.get("samples", [])]
        if len(saved) == len(self.samples):
            self.samples = saved
        caps = extra.get("micro_batch_sizes")
        if isinstance(caps, list) and len(caps) == len(self.guard.micro_batch_sizes):
            self.guard.micro_batch_sizes = [None if c is None else int(c) for c in caps]
        self.guard.resplits = int(extra.get("resplits", 0))
        self.guard.skipped = int(extra.get("skipped", 0))

    # -- data --------------------------------------------------------------------------------

    def _collate_indices(self, indices: list[int]) -> Batch:
        if self._batch_fn is not None:
            return self._batch_fn(indices)
        return self._collate([self.data[i] for i in indices])

    def _batches(self) -> Iterator[tuple[Batch, int]]:
        """Each step's batch on this rank's device, with the step's sample count over ranks."""
        # Resumes mid-epoch: the sampler is deterministic in (seed, epoch), so skipping the
        # batches already seen puts the run exactly where it stopped.
        while True:
            self.sampler.set_epoch(self.epoch)
            for i, indices in enumerate(self.sampler):
                if i < self.batch_in_epoch:
                    continue
                self.batch_in_epoch = i + 1
                batch = self._collate_indices(list(indices))
                # Every rank knows every rank's share: the global count needs no all-reduce.
                count = self.sampler.samples_in_step(i)
                yield map_tensors(batch, lambda t: to_device(t, self.device)), count
            self.epoch += 1
            self.batch_in_epoch = 0

    # -- evaluation --------------------------------------------------------------------------

    def _evaluate(self) -> dict[str, float] | None:
        """Evaluate ``eval_data`` now (on every rank: the sums meet in one gather); record it."""
        data = self.eval_data
        if data is None:
            return None
        batch_fn = getattr(data, "batch", None)
        empty_safe = EmptySafeCollate(data)

        def collate(indices: list[int]) -> Batch:
            return (
                batch_fn(indices) if callable(batch_fn) else empty_safe([data[i] for i in indices])
            )

        if self.distributed:
            metrics = evaluate_ranks(
                self.model, data, self.eval_fn, batch_sizes=self.sampler.batch_sizes,
                collate=collate, device=self.device, autocast=self._autocast,
                every_step=self.config.strategy == "fsdp2",  # FSDP2's forward all-gathers
            )  # fmt: skip
        else:
            dp = cast(BalancedDataParallel, self.wrapped)  # one process: always DP
            metrics = evaluate_devices(
                self.model, data, self.eval_fn, batch_size=self.config.batch_size,
                device_ids=dp.device_ids, weights=dp.weights,
                collate=collate, autocast=self._autocast,
            )  # fmt: skip
        self.evals.append({"step": self.step, "metrics": metrics})
        return metrics

    def _eval_text(self) -> str:
        if not self.evals:
            return ""
        return "".join(f" val {k} {v:.4f}" for k, v in self.evals[-1]["metrics"].items())

    # -- one step ----------------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.config.amp == "none":
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.config.amp == "bf16" else torch.float16
        return torch.autocast(self.device.type, dtype=dtype)

    def _train_step(self, batch: Batch, global_count: int) -> float | None:
        """One optimizer step on this rank's ``batch``; ``global_count`` samples over ranks.

        Returns the global batch's mean loss, or ``None`` when the step was skipped (OOM).
        """
        n = _batch_len(batch)
        # Each device's share of this batch: consecutive samples starting at offsets[i].
        shares = self.wrapped.split(n) if isinstance(self.wrapped, BalancedDataParallel) else [n]
        offsets = [sum(shares[:i]) for i in range(len(shares))]
        accum = [math.ceil(s / self.config.accum) if s else None for s in shares]

        def chunk_loss(spans: list[tuple[int, int]]) -> torch.Tensor:
            # spans[i]: this micro-step's samples of device i's own share.
            part = _rows(batch, [(o + a, o + b) for o, (a, b) in zip(offsets, spans, strict=True)])
            # Plain DDP (no OOM re-split): all-reduce only on the last micro-batch's backward.
            last = self.guard.micro_step == self.guard.micro_step_count - 1
            sync = (
                self.wrapped.no_sync()
                if isinstance(self.wrapped, nn.parallel.DistributedDataParallel) and not last
                else contextlib.nullcontext()
            )
            if self.fsdp:  # reduce-scatter gradients only after the last micro-batch
                self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
            if isinstance(self.wrapped, BalancedDataParallel):
                self.wrapped._sizes = [b - a for a, b in spans]  # this micro-step's exact rows
            with sync, self._autocast():
                loss = (
                    self.wrapped(*part) if isinstance(part, (tuple, list)) else self.wrapped(part)
                )
            if self.guard.micro_step == 0:
                attempt.clear()  # an OOM restarts the step from sample 0: count the last try
            if isinstance(self.wrapped, BalancedDataParallel):
                attempt.append(list(self.wrapped.last_sizes))
            else:
                ran = spans[0][1] - spans[0][0]
                attempt.append([ran if r == self.rank else 0 for r in range(self.world)])
            return loss.float()

        def backward(loss: torch.Tensor) -> None:
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

        self.optimizer.zero_grad(set_to_none=True)
        attempt: list[list[int]] = []  # per micro-step, the samples each device ran
        # DDP and FSDP2 run collectives inside forward/backward: every rank must run as many
        # micro-steps as the others, even with no samples (FSDP2: always `accum`, the most any
        # share is cut into; plain DDP: one synced backward). The OOM-safe DDP path has none.
        if self.fsdp:
            min_micro_steps = self.config.accum
        elif isinstance(self.wrapped, nn.parallel.DistributedDataParallel):
            min_micro_steps = 1
        else:
            min_micro_steps = 0
        try:
            total = self.guard.run_shares(
                shares,
                chunk_loss,
                weight=self.world / global_count,
                zero_grad=lambda: self.optimizer.zero_grad(set_to_none=True),
                backward=backward,
                micro_batch_sizes=accum,
                min_micro_steps=min_micro_steps,
            )
        finally:
            if isinstance(self.wrapped, BalancedDataParallel):
                self.wrapped._sizes = None  # the user's weights again, outside a step
        self.micro_steps = attempt
        if total is None:
            return None
        for sizes in attempt:
            self.samples = [a + b for a, b in zip(self.samples, sizes, strict=True)]
        if self.distributed and self.config.oom_resplit and not self.fsdp:
            all_reduce_gradients(self.model.parameters())
        if self.distributed:
            reduced = total.to(comm_device())
            dist.all_reduce(reduced)
            total = reduced.cpu()
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip the true gradient, not the scaled one
        if self.config.grad_clip is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.config.grad_clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        return float(total) / self.world

    # -- the loop ----------------------------------------------------------------------------

    def _memory_text(self) -> str:
        if self.device.type != "cuda":
            return "-"
        devices = [self.device] if self.distributed else self.dp_devices
        seen = dict.fromkeys(d for d in devices if d.type == "cuda")
        return " ".join(format_bytes(torch.cuda.max_memory_allocated(d)) for d in seen)

    def _micro_text(self) -> str:
        # Shown only once an OOM (or a resumed run) capped some device's micro-batches.
        caps = self.guard.micro_batch_sizes
        if all(c is None for c in caps):
            return ""
        return " micro-batch " + "/".join("all" if c is None else str(c) for c in caps)

    def fit(self) -> TrainReport:
        """Run until ``config.steps`` optimizer steps are done; return the report.

        Ctrl-C saves a checkpoint (when ``out_dir`` is set) and returns the report so far
        with ``interrupted=True``.
        """
        cfg = self.config
        torch.manual_seed(cfg.seed + self.rank)
        if cfg.resume:
            self._resume()
        start_step = self.step
        self.model.train()
        interrupted = False
        started = time.perf_counter()
        batches = self._batches()
        show = cfg.progress and self.rank == 0
        try:
            with TrainProgress(cfg.steps, enabled=show, start=self.step) as bar:
                while self.step < cfg.steps:
                    batch, count = next(batches)
                    loss = self._train_step(batch, count)
                    self.step += 1
                    if loss is not None:
                        self.losses.append(loss)
                    if self.eval_data is not None and self._eval_due(cfg.steps):
                        self._evaluate()
                    text = self._memory_text() + self._micro_text() if show else ""
                    bar.update(self.step, loss, count, text + self._eval_text())
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                        self.save()
        except KeyboardInterrupt:
            interrupted = True
        elapsed = time.perf_counter() - started
        self.save()
        return self._report(self.step - start_step, elapsed, interrupted)

    def _eval_due(self, last: int) -> bool:
        every = self.config.eval_every
        return self.step == last or bool(every and self.step % every == 0)

    def _report(self, steps_run: int, elapsed: float, interrupted: bool) -> TrainReport:
        samples = list(self.samples)
        if self.distributed:
            t = torch.tensor(samples, dtype=torch.float64, device=comm_device())
            dist.all_reduce(t)  # each rank counted only its own share
            samples = [int(v) for v in t.tolist()]
        done = max(self.step - self.guard.skipped, 1)  # skipped steps trained no samples
        stats = []
        for i, name in enumerate(self.device_names):
            peak = None
            if self.device.type == "cuda" and not self.distributed:
                dev = self.dp_devices[i]
                peak = int(torch.cuda.max_memory_allocated(dev)) if dev.type == "cuda" else None
            elif self.device.type == "cuda" and i == self.rank:
                peak = int(torch.cuda.max_memory_allocated(self.device))
            stats.append(DeviceStat(name, samples[i] / done, peak))
        per_step = sum(s.samples_per_step for s in stats)
        return TrainReport(
            devices=stats,
            losses=list(self.losses),
            steps=self.step,
            global_batch=round(per_step),
            samples_per_s=per_step * steps_run / max(elapsed, 1e-9),
            elapsed_s=elapsed,
            resplits=self.guard.resplits,
            skipped_steps=self.guard.skipped,
            micro_batch_size=self.guard.micro_batch_size,
            interrupted=interrupted,
            mode=("fsdp2" if self.fsdp else "ddp") if self.distributed else "dp",
            amp=self.config.amp,
            eval=list(self.evals),
        )


def _validate_fsdp2(config: TrainConfig, optimizer: torch.optim.Optimizer | None) -> None:
    if optimizer is not None:
        raise EvendpError(
            "strategy='fsdp2' shards the parameters, so an optimizer built before would update "
            "stale tensors; pass optimizer=None (AdamW with config.lr is built after sharding)"
        )
    if config.out_dir is not None:
        raise EvendpError(
            "the Trainer does not checkpoint FSDP2 models yet; pass out_dir=None, or use "
            "strategy='ddp', or save with torch.distributed.checkpoint yourself"
        )


def _shard(model: nn.Module) -> None:
    # One FSDP2 unit per repeated block (their all-gathers overlap compute), then the root.
    from torch.distributed.fsdp import fully_shard

    for block in _blocks(model):
        fully_shard(block)
    fully_shard(model)
