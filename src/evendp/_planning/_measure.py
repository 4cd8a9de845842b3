"""Measuring: one training step (or one forward under ``no_grad``) run on fake tensors,
memory by kind at each phase.

The model is built (or copied) under ``FakeTensorMode`` on fake *cpu* tensors, so no real
memory is touched and an 8-GPU, 40 GB model plans in seconds; fake ``cuda`` tensors cannot
run backward on a machine with no GPU. ``MemTracker`` records every storage of one training
step (forward, loss, backward, optimizer step), by kind, and the peak of each phase. The
results are :class:`Point` records: plain numbers that :mod:`._solve` turns into curves.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from .._core._amp import amp_dtype
from .._core._blocks import block_predicate
from .._core._calls import call
from .._core._errors import EvendpError, PlanError
from ._allocator import Trace
from ._fake_model import fake_cpu_copy, off_cpu

__all__ = [
    "ModelLike",
    "OptimizerFactory",
    "Point",
    "apply_checkpointing",
    "at_width",
    "make_setup",
    "measure_gathered",
    "measure_replica",
    "planning_errors",
    "profile_step",
    "loss_of",
    "sample_output",
    "tensors",
    "validate_batch",
]

ModelLike = nn.Module | Callable[[], nn.Module]
OptimizerFactory = Callable[[Any], torch.optim.Optimizer]


def _tracker_class() -> type:
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):
        """MemTracker whose peak can be restarted, so each phase gets its own peak, and
        which records the step's storage events in order for :mod:`._allocator`."""

        def __init__(self) -> None:
            super().__init__()
            self.trace = Trace()

        def reset_peak(self) -> None:
            # Private fields of MemTracker (torch >= 2.4): the running peak and its snapshot.
            self._peak_mem_snap = self.get_tracker_snapshot()
            self._peak_mem = {d: s["Total"] for d, s in self._peak_mem_snap.items()}

        def _update_snap(self, u_type: Any, winfo: Any, *args: Any, **kwargs: Any) -> None:
            # MemTracker's one place where a storage's bytes come and go (torch >= 2.4).
            super()._update_snap(u_type, winfo, *args, **kwargs)
            self.trace.storage(u_type.name, winfo, kwargs.get("old_mem_consumed"))

        def __exit__(self, *args: Any) -> None:
            super().__exit__(*args)
            if self._depth == 0:
                self.trace.close()  # what dies after the step (model, optimizer) is not in it

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            out = super().__torch_dispatch__(func, types, args, kwargs)
            # After the op: its outputs exist, then the library call takes its workspace.
            self.trace.op(func, self._mod_tracker.is_bw, args)
            return out

    return _Tracker


def _kinds(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """MemTracker snapshot (per device, per ``_MemRefType``) -> bytes by kind name."""
    out: dict[str, int] = {}
    for per_kind in snapshot.values():
        for key, value in per_kind.items():
            name = getattr(key, "name", str(key))
            out[name] = out.get(name, 0) + int(value)
    return out


def tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(tree: Any) -> int:
    """Bytes of the distinct storages under ``tree``."""
    storages = {id(st): st.nbytes() for st in (t.untyped_storage() for t in tensors(tree))}
    return sum(storages.values())


class _Handoff(torch.autograd.Function):
    """Stand-in for DP's gather: the replica's outputs leave the device (tiny stand-ins stay),
    and in backward their full-size gradients arrive, as ``Scatter`` would deliver them."""

    @staticmethod
    def forward(ctx: Any, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.meta = [(x.shape, x.dtype) for x in xs]
        return tuple(x.new_zeros(()) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(torch.ones(shape, dtype=dtype) for shape, dtype in ctx.meta)


def loss_of(output: Any) -> torch.Tensor:
    """The loss a model computed in ``forward`` (its first floating scalar), else a stand-in
    (mean of every floating output) whose backward allocates the same gradients."""
    floats = [t for t in tensors(output) if t.is_floating_point() and t.requires_grad]
    for t in floats:
        if t.dim() == 0:
            return t
    if not floats:
        raise PlanError(
            "the model's output has no floating tensor that requires grad, so there is nothing "
            "to backpropagate; return logits or a loss from forward, or pass criterion="
        )
    return sum((t.float().mean() for t in floats), torch.zeros(()))


class _FusedAttention(TorchFunctionMode):
    """Attention as a GPU's fused kernels keep it, for a step planned for a GPU.

    The fake step runs on *cpu* tensors, where ``F.scaled_dot_product_attention`` with
    ``dropout_p > 0`` (HF GPT-2's ``attn_pdrop=0.1`` while training) takes the math path and
    saves the ``heads x T x T`` matrix and a dropout mask; CUDA's flash and memory-efficient
    kernels draw dropout inside the kernel and save only the output and a log-sum-exp per row
    (PyTorch's SDPA notes): about a third of GPT-2 124M's activations at sequence 512. Values
    never matter on fake tensors, so attention runs with ``dropout_p=0``.
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is F.scaled_dot_product_attention:
            if len(args) > 4:  # dropout_p given by position: (q, k, v, attn_mask, dropout_p)
                args = (*args[:4], 0.0, *args[5:])
            elif kwargs.get("dropout_p"):
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


@dataclass
class _Setup:
    """Everything a fake step needs, already validated."""

    make_model: Callable[[], nn.Module]  # a fresh model on fake tensors
    make_batch: Callable[[int], Any]
    criterion: Callable[..., torch.Tensor] | None
    optimizer: OptimizerFactory | None
    amp: torch.dtype | None
    checkpointing: bool | Callable[[nn.Module], bool]
    fake_mode: Any = None
    no_grad: bool = False  # forward only: no gradients, optimizer state or saved activations
    gpu: bool = False  # planned for a CUDA GPU: attention saves what its fused kernels save

    def autocast(self) -> AbstractContextManager[Any]:
        if self.amp is None:
            return nullcontext()
        return torch.autocast("cpu", dtype=self.amp)


def apply_checkpointing(model: nn.Module, which: bool | Callable[[nn.Module], bool]) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        apply_activation_checkpointing,
    )

    check: Callable[[nn.Module], bool]
    if which is True:
        check = block_predicate(model)  # the blocks the Trainer checkpoints too
    elif callable(which):
        check = which
    else:
        return
    apply_activation_checkpointing(model, check_fn=check)


def _fresh_model(setup: _Setup) -> nn.Module:
    model = setup.make_model()
    if off_cpu(model):  # a factory's GPU or meta tensors: fake cpu ones (see _fake_model)
        model = fake_cpu_copy(model, setup.fake_mode)
    if setup.no_grad:
        model.eval()  # inference: dropout off, BatchNorm reads its running statistics
        return model  # checkpointing only trades memory saved for backward: none here
    model.train()
    apply_checkpointing(model, setup.checkpointing)
    return model


def _make_optimizer(setup: _Setup, model: nn.Module) -> torch.optim.Optimizer | None:
    if setup.optimizer is None:
        return None
    opt = setup.optimizer(model.parameters())
    for group in opt.param_groups:
        # On CUDA, optimizers default to the multi-tensor (foreach) path, whose temporaries
        # differ from the per-parameter loop CPU tensors default to: measure the CUDA one.
        if group.get("foreach", False) is None and not group.get("fused", False):
            group["foreach"] = True
    return opt


@dataclass(frozen=True)
class Point:
    """One measured replica step at batch size ``n``."""

    n: int
    fwbw: dict[str, float]  # at the forward+backward peak: params, grads, activations, outputs
    forward_end: dict[str, float]  # after forward (and the DP hand-off): params, activations
    output_bytes: int
    static: dict[str, int]  # params, grads, optimizer, optimizer_extra (optimizer-step temps)
    trace: Trace | None = None  # the step's storage events in order (see ._allocator)


def measure_replica(setup: _Setup, n: int, variant: str) -> Point:
    """One fake step at batch size ``n``. ``variant``: ``keep`` (outputs held through the
    step: DDP, DP without gather), ``drop`` (DP, loss inside the model: outputs are copied
    away), ``handoff`` (DP with a criterion on the output device). Under ``setup.no_grad``
    the variant does not matter: see :func:`measure_forward`."""
    if setup.no_grad:
        return measure_forward(setup, n)
    model = _fresh_model(setup)
    tracker = _tracker_class()()
    with setup.fake_mode:
        opt = _make_optimizer(setup, model)
        with tracker:
            batch = setup.make_batch(n)
            inputs, targets = batch if setup.criterion is not None else (batch, None)
            tracker.reset_peak()
            tracker.trace.mark_step()  # the batch is in; the step begins
            with setup.autocast(), _FusedAttention() if setup.gpu else nullcontext():
                output = call(model, inputs)
                output_bytes = _nbytes(output)
                if variant == "handoff":
                    outs = [t for t in tensors(output) if t.requires_grad]
                    loss: torch.Tensor = sum(_Handoff.apply(*outs), torch.zeros(()))
                    del outs
                elif setup.criterion is not None and targets is not None:
                    loss = setup.criterion(output, targets)
                else:
                    loss = loss_of(output)
            if variant != "keep":
                del output  # DP copies outputs to the output device; the replica's go
            fwd = _kinds(tracker.get_tracker_snapshot())
            loss.backward()
            del loss
            peak = _kinds(tracker.get_tracker_snapshot("peak"))
            after_bw = _kinds(tracker.get_tracker_snapshot())
            tracker.reset_peak()
            before_opt = after_bw["Total"]
            optimizer_bytes = extra = 0
            if opt is not None:
                opt.step()
                opt_peak = _kinds(tracker.get_tracker_snapshot("peak"))
                optimizer_bytes = _kinds(tracker.get_tracker_snapshot()).get("OPT", 0)
                extra = max(0, opt_peak["Total"] - before_opt - optimizer_bytes)
                opt.zero_grad(set_to_none=True)
    params = peak.get("PARAM", 0) + peak.get("BUFFER", 0)
    fwbw_out = min(output_bytes, peak.get("ACT", 0) + peak.get("TEMP", 0))
    fwbw = {
        "params": float(params),
        "grads": float(peak.get("GRAD", 0)),
        "outputs": float(fwbw_out),
        "activations": float(peak["Total"] - params - peak.get("GRAD", 0) - fwbw_out),
    }
    fparams = fwd.get("PARAM", 0) + fwd.get("BUFFER", 0)
    forward_end = {"params": float(fparams), "activations": float(fwd["Total"] - fparams)}
    static = {
        "params": params,
        "grads": after_bw.get("GRAD", 0),
        "optimizer": optimizer_bytes,
        "optimizer_extra": extra,
    }
    return Point(n, fwbw, forward_end, output_bytes, static, tracker.trace)


def measure_forward(setup: _Setup, n: int) -> Point:
    """One fake forward at batch size ``n`` under ``torch.no_grad`` (inference, evaluation).

    No gradients, no optimizer state, and no activations saved for a backward: the peak is
    the parameters plus the forward's largest live temporaries plus the outputs. With a
    criterion, the loss on this device's outputs (as a per-device evaluation computes it) is
    part of the step. The outputs stay held after the forward (``forward_end``): DP copies
    them to the output device before the replica lets them go.
    """
    model = _fresh_model(setup)
    tracker = _tracker_class()()
    with setup.fake_mode, tracker:
        batch = setup.make_batch(n)
        inputs, targets = batch if setup.criterion is not None else (batch, None)
        tracker.reset_peak()
        tracker.trace.mark_step()
        with torch.no_grad(), setup.autocast():
            output = call(model, inputs)
            output_bytes = _nbytes(output)
            if setup.criterion is not None and targets is not None:
                setup.criterion(output, targets)  # its temporaries count; its value does not
        fwd = _kinds(tracker.get_tracker_snapshot())
        peak = _kinds(tracker.get_tracker_snapshot("peak"))
        del output
    params = peak.get("PARAM", 0) + peak.get("BUFFER", 0)
    out = min(output_bytes, peak["Total"] - params)
    fwd_params = fwd.get("PARAM", 0) + fwd.get("BUFFER", 0)
    return Point(
        n,
        {
            "params": float(params),
            "outputs": float(out),
            "activations": float(peak["Total"] - params - out),
        },
        {"params": float(fwd_params), "activations": float(fwd["Total"] - fwd_params)},
        output_bytes,
        {"params": params, "grads": 0, "optimizer": 0, "optimizer_extra": 0},
        tracker.trace,
    )


def measure_gathered(setup: _Setup, sample_output: Any, n_sample: int, total: int) -> Point:
    """DP's output device at global batch ``total``: gathered outputs, their gradient, the loss.

    ``sample_output`` is a replica output at batch ``n_sample`` (shapes and dtypes only).
    Under ``setup.no_grad`` the loss is computed without a backward: no gathered gradient.
    """
    assert setup.criterion is not None  # only called with a criterion (internal invariant)
    tracker = _tracker_class()()
    wants_grad = not setup.no_grad
    with setup.fake_mode, torch.set_grad_enabled(wants_grad):
        _, targets = setup.make_batch(total)
        with tracker:

            def grow(t: Any) -> Any:
                if not isinstance(t, torch.Tensor):
                    return t
                if t.dim() == 0:  # DP gathers scalars into one entry per device
                    return torch.zeros(
                        (1,), dtype=t.dtype, requires_grad=wants_grad and t.requires_grad
                    )
                shape = (t.shape[0] * total // max(n_sample, 1), *t.shape[1:])
                grad = wants_grad and t.is_floating_point()
                return torch.zeros(shape, dtype=t.dtype, requires_grad=grad)

            gathered = tree_map(grow, sample_output)
            tracker.reset_peak()
            with setup.autocast():
                loss = setup.criterion(gathered, targets)
            if wants_grad:
                loss.backward()
            peak = _kinds(tracker.get_tracker_snapshot("peak"))
            grads = [t.grad for t in tensors(gathered) if t.grad is not None]
            g_bytes = _nbytes(gathered)
            grad_bytes = _nbytes(grads)
            t_bytes = _nbytes(targets)
    held = {"gathered_outputs": float(g_bytes), "gathered_grad": float(grad_bytes)}
    loss_bytes = max(0, peak["Total"] - g_bytes - grad_bytes) + t_bytes
    crit = {**held, "loss": float(loss_bytes)}
    return Point(total, crit, {**held, "loss": float(t_bytes)}, g_bytes, {})


def sample_output(setup: _Setup, n: int) -> Any:
    """A replica's outputs at batch ``n`` (fake; only shapes and dtypes are used)."""
    model = _fresh_model(setup)
    with setup.fake_mode, torch.no_grad():
        inputs, _ = setup.make_batch(n)
        with setup.autocast():
            out = call(model, inputs)
        return tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, out)


def _validate_model(model: Any) -> Callable[[Any], nn.Module]:
    """A function of the fake mode that returns a fresh fake copy of the model."""
    if isinstance(model, nn.Module):  # fake cpu tensors wherever it sits: see _fake_model
        return lambda fake_mode: fake_cpu_copy(model, fake_mode)
    if callable(model):

        def build(fake_mode: Any) -> nn.Module:
            with fake_mode:
                built = model()
            if not isinstance(built, nn.Module):
                raise EvendpError(
                    f"the model factory returned {type(built).__name__}, not an nn.Module"
                )
            return built

        return build
    raise EvendpError(f"model must be an nn.Module or a function returning one, got {model!r}")


def at_width(batch: Any, width: int) -> Any:
    """The example ``batch`` with its sequence dimension (dim 1 of the tensors whose dim 1 is
    the first such tensor's) set to ``width``; values do not matter on fake tensors.

    >>> ids, labels = at_width((torch.zeros(2, 5, dtype=torch.long), torch.zeros(2)), 8)
    >>> tuple(ids.shape), ids.dtype, tuple(labels.shape)
    ((2, 8), torch.int64, (2,))
    """
    wide = [t for t in tensors(batch) if t.dim() >= 2]
    old = wide[0].shape[1] if wide else None

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[1] != old:
            return t
        return torch.zeros((t.shape[0], width, *t.shape[2:]), dtype=t.dtype)

    return tree_map(one, batch)


def validate_batch(batch: Any) -> Callable[[int], Any]:
    if callable(batch) and not isinstance(batch, torch.Tensor):
        return batch
    if not tensors(batch):
        raise EvendpError(
            f"batch must hold tensors (batch dimension 0) or be a function of the batch size, "
            f"got {batch!r}"
        )

    def resize(n: int) -> Any:
        # Fresh fake tensors of the example's dtypes with n samples: no values are needed.
        def one(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            shape = (n, *t.shape[1:]) if t.dim() else ()
            return torch.zeros(shape, dtype=t.dtype)

        return tree_map(one, batch)

    return resize


@contextmanager
def planning_errors(what: str, error: type[EvendpError] = PlanError) -> Iterator[None]:
    """Turn failures inside the user's model, batch or criterion into ``error``."""
    try:
        yield
    except EvendpError:
        raise
    except Exception as exc:  # the user's code can raise anything; say where it happened
        raise error(f"{what} failed: {type(exc).__name__}: {exc}") from exc


def make_setup(
    model: ModelLike,
    batch: Any,
    criterion: Callable[..., torch.Tensor] | None,
    optimizer: OptimizerFactory | None,
    amp: torch.dtype | str | None,
    checkpointing: bool | Callable[[nn.Module], bool],
    no_grad: bool = False,
) -> _Setup:
    from torch._subclasses.fake_tensor import FakeTensorMode

    amp = amp_dtype(amp)  # a dtype, or a TrainConfig spelling ("bf16"): the one conversion
    if amp not in (None, torch.float16, torch.bfloat16):
        raise EvendpError(f"amp must be None, torch.float16 or torch.bfloat16, got {amp!r}")
    make = _validate_model(model)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    return _Setup(
        lambda: make(fake_mode),
        validate_batch(batch),
        criterion,
        optimizer,
        amp,
        checkpointing,
        fake_mode,
        no_grad,
    )


def profile_step(
    model: ModelLike,
    batch: Any,
    sizes: Sequence[int] = (8, 16),
    *,
    criterion: Callable[..., torch.Tensor] | None = None,
    optimizer: OptimizerFactory | None = torch.optim.AdamW,
    amp: torch.dtype | str | None = None,
    checkpointing: bool | Callable[[nn.Module], bool] = False,
    no_grad: bool = False,
) -> dict[str, Any]:
    """Measure one training step on fake tensors at each batch size in ``sizes``.

    With ``no_grad=True`` the step is one forward under ``torch.no_grad`` (model in eval
    mode): ``peak_bytes`` is the forward's peak and ``grads`` and ``optimizer`` are 0.

    Returns ``{"sizes", "params", "grads", "optimizer", "forward_bytes", "peak_bytes",
    "output_bytes"}``: the static bytes, and per size the memory held after forward (saved
    activations and outputs, parameters excluded) and the forward+backward peak (parameters
    included). The slope of ``forward_bytes`` is the activation bytes per sample.

    >>> net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    >>> p = profile_step(net, torch.randn(2, 32), sizes=(8, 16), optimizer=None)
    >>> p["params"] == sum(t.numel() * 4 for t in net.parameters())
    True
    >>> # per sample: the input, ReLU's output (saved), the logits: (32 + 64 + 4) * 4 bytes
    >>> (p["forward_bytes"][1] - p["forward_bytes"][0]) / 8
    400.0
    """
    setup = make_setup(model, batch, criterion, optimizer, amp, checkpointing, no_grad)
    with planning_errors("measuring the model on fake tensors"):
        points = [measure_replica(setup, int(n), "keep") for n in sizes]
    return {
        "sizes": [p.n for p in points],
        "params": points[0].static["params"],
        "grads": points[0].static["grads"],
        "optimizer": points[0].static["optimizer"],
        "forward_bytes": [p.forward_end["activations"] for p in points],
        "peak_bytes": [sum(p.fwbw.values()) for p in points],
        "output_bytes": [p.output_bytes for p in points],
    }
