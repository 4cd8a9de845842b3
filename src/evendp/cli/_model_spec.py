"""``--model`` (``gpt``, ``lm-head``, ``package.module:factory``, ``file.py:factory``) and the
planner's options of ``evendp plan`` and ``evendp launch``, as :func:`evendp.plan` takes them."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, cast

from .._core._amp import AMP_MODES, amp_dtype
from .._core._errors import EvendpError
from .._core._units import parse_bytes
from .._core._validate import shown
from .._planning._memory import (
    DEFAULT_CONTEXT,
    DeviceMemory,
    LiveMemoryError,
    live_memory,
    parse_memory,
)
from ._args import add_int, bounded_float, suggest

if TYPE_CHECKING:  # torch loads when a model is resolved: evendp launch without --model
    import torch  # needs none
    from torch import nn

__all__ = [
    "ModelSpec",
    "add_model_arguments",
    "gpt_batch",
    "load_module",
    "memory_specs",
    "plan_options",
    "raised_at",
    "resolve_model",
]

#: --optimizer's choices: the optimizer whose state a plan counts (see _optimizer).
OPTIMIZERS: tuple[str, ...] = ("adam", "adamw", "none", "sgd")


def _optimizer(name: str) -> Callable[[Any], torch.optim.Optimizer] | None:
    import torch

    if name == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "none": None}[name]


@dataclass(frozen=True)
class ModelSpec:
    """What :func:`evendp.plan` needs about a model: a factory, ``batch(n)`` and a criterion.

    >>> spec = resolve_model("lm-head", vocab=50, seq_len=8)
    >>> x, y = spec.batch(3)
    >>> tuple(x.shape), spec.criterion is not None
    ((3, 8), True)
    """

    make: Callable[[], nn.Module]
    batch: Callable[[int], Any]
    criterion: Callable[..., torch.Tensor] | None = None


def add_model_arguments(parser: argparse._ActionsContainer, *, default: str | None) -> None:
    """Add ``--model`` (optional when ``default=None``) and the planner's options to ``parser``.

    >>> p = argparse.ArgumentParser()
    >>> add_model_arguments(p, default="gpt")
    >>> a = p.parse_args(["--model", "lm-head", "--vocab", "100", "--amp", "bf16"])
    >>> a.model, a.vocab, plan_options(a)["amp"]
    ('lm-head', 100, torch.bfloat16)
    """
    parser.add_argument(
        "--model",
        default=default,
        help="'gpt' (the demo char GPT), 'lm-head', 'package.module:factory' or "
        "'path/to/file.py:factory', where "
        "factory() returns (model, batch_fn) or (model, batch_fn, criterion), or a model "
        f"with an example_batch(n) method (default: {default or 'none'})",
    )
    add_int(parser, "--vocab", (1, 10_000_000, 40_000), 40_000, "lm-head vocabulary size")
    own = "lm-head / gpt sequence length (default: the model's own)"
    add_int(parser, "--seq-len", (1, 1_000_000, 512), None, own)
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="optimizer whose state the plan counts (default adamw; none: no state)",
    )
    parser.add_argument(
        "--amp",
        choices=sorted(AMP_MODES),
        default="none",
        help="plan under autocast to bf16 / fp16 (default none: fp32)",
    )
    parser.add_argument("--checkpointing", action="store_true", help="checkpoint each block")
    parser.add_argument("--bucket-view", action="store_true", help="DDP gradient_as_bucket_view")
    parser.add_argument(
        "--margin",
        type=bounded_float("--margin", 0.0, 0.99, "0.05", low_inclusive=True),
        default=None,
        help="fraction of each device's memory kept free (default 0.05; 0 on CUDA devices, "
        "where the allocator model's fragmentation allowance is the margin)",
    )
    parser.add_argument(
        "--context",
        default=f"{DEFAULT_CONTEXT >> 20}MiB",
        help=f"CUDA context allowance per device (default {DEFAULT_CONTEXT >> 20}MiB)",
    )


def plan_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of :func:`evendp.plan` that the options added above set (a bad
    ``--context`` named by its flag, not by the argument it becomes)."""
    try:
        parse_bytes(args.context)
    except EvendpError:
        raise EvendpError(
            f"--context {shown(args.context)} is not a size; e.g. --context "
            f"{DEFAULT_CONTEXT >> 20}MiB"
        ) from None
    return {
        "optimizer": _optimizer(args.optimizer),
        "amp": amp_dtype(args.amp),
        "checkpointing": args.checkpointing,
        "gradient_as_bucket_view": args.bucket_view,
        "safety_margin": args.margin,
        "cuda_context": args.context,
    }


def memory_specs(text: str | None) -> list[DeviceMemory]:
    """``--memory TEXT`` as the planner's devices; without it, the live GPUs' free memory.

    >>> [d.free >> 30 for d in memory_specs("24GiB,2x12GiB")]
    [24, 12, 12]
    """
    if text is not None:
        try:
            return parse_memory(text)
        except EvendpError as exc:
            raise EvendpError(f"--memory {shown(text)}: {exc}") from None
    try:
        return live_memory()
    except LiveMemoryError as exc:
        raise EvendpError(
            f"{exc.reason}; declare each device's memory instead, e.g. --memory 24GiB,24GiB,12GiB"
        ) from None


def raised_at(exc: BaseException) -> str:
    """``" at FILE:LINE in NAME"``: the innermost frame of ``exc`` outside Python's libraries
    and evendp (``""`` when none is the user's).

    >>> def make():
    ...     return int("x")
    >>> try:
    ...     make()
    ... except ValueError as exc:
    ...     raised_at(exc).endswith(" in make")
    True
    """
    import sysconfig
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    theirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    ours = str(Path(__file__).resolve().parents[1])
    mine = [
        f for f in frames
        if not any(f.filename.startswith(root) for root in (*theirs, ours))
    ]  # fmt: skip
    if not mine:
        return ""
    return f" at {mine[-1].filename}:{mine[-1].lineno} in {mine[-1].name}"


def resolve_model(spec: str, *, vocab: int = 40_000, seq_len: int | None = None) -> ModelSpec:
    """A built-in model by name or a user's factory; :class:`EvendpError` when it cannot be had.

    >>> resolve_model("nonsense")
    Traceback (most recent call last):
    ...
    evendp.InputError: --model 'nonsense' is not 'gpt', 'lm-head', ...
    """
    if spec == "gpt":
        from ..examples.gpt import GPT, GPTConfig

        config = GPTConfig() if seq_len is None else GPTConfig(block_size=seq_len)
        return ModelSpec(lambda: GPT(config), gpt_batch(config))
    if spec != "lm-head":
        return _user(spec)
    import torch

    from ..examples.lm_head import LMHead, lm_loss

    seq = 250 if seq_len is None else seq_len

    def lm_batch(n: int) -> Any:
        return torch.randint(0, vocab, (n, seq)), torch.randint(0, vocab, (n, seq))

    return ModelSpec(lambda: LMHead(vocab, seq), lm_batch, lm_loss)


def gpt_batch(config: Any) -> Any:
    """``batch(n)`` for the planner: ``n`` random token windows of this GPT's shape."""

    import torch

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (n, config.block_size)
        return torch.randint(0, config.vocab_size, shape), torch.randint(0, 2, shape)

    return batch


def _user(spec: str) -> ModelSpec:
    module_name, _, attr = spec.rpartition(":")
    if spec.endswith(".py") and not module_name:
        raise EvendpError(
            f"--model {spec!r} names a file but not the factory in it; add it after a colon, "
            f"e.g. --model {spec}:make_model"
        )
    if not module_name or not attr:
        raise EvendpError(
            f"--model {shown(spec)} is not 'gpt', 'lm-head', 'package.module:factory' or "
            "'path/to/file.py:factory'; e.g. --model mypkg.models:make_model"
        )
    try:
        module = load_module(spec, module_name)
        factory = getattr(module, attr) if hasattr(module, attr) else _no_factory(spec, module)
    except EvendpError:
        raise
    except (ImportError, AttributeError) as exc:
        raise EvendpError(f"cannot load --model {shown(spec)}: {exc}") from exc
    except Exception as exc:  # the user's module runs on import and can raise anything
        raise EvendpError(
            f"cannot load --model {shown(spec)}: importing it raised {type(exc).__name__}"
            f"{raised_at(exc)}: {exc}"
        ) from exc
    from torch import nn
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        # A probe: what the factory returns, on fake memory. A factory that builds on meta
        # makes some real meta tensors there (BatchNorm's counter): allowed in, as the planner's.
        with FakeTensorMode(allow_non_fake_inputs=True):
            made = factory()
    except Exception as exc:  # the user's factory can raise anything
        raise EvendpError(
            f"the model factory {shown(spec)} failed{raised_at(exc)}: {type(exc).__name__}: {exc}"
        ) from exc
    if isinstance(made, nn.Module):
        if not hasattr(made, "example_batch"):
            raise EvendpError(
                f"{shown(spec)} returned a model without example_batch(n); return "
                "(model, batch_fn) or (model, batch_fn, criterion) instead"
            )
        # The probe's method: one model, not one built per batch request.
        batch_fn = cast("Callable[[int], Any]", made.example_batch)
        _probe_call(spec, made, batch_fn, None)
        return ModelSpec(factory, batch_fn)
    if isinstance(made, tuple) and len(made) in (2, 3) and isinstance(made[0], nn.Module):
        if not callable(made[1]) and hasattr(made[1], "__getitem__"):
            raise EvendpError(
                f"--model {shown(spec)} returned (model, {type(made[1]).__name__}): a dataset, "
                "what evendp train --model takes; plan and launch --model need (model, "
                "batch_fn) or (model, batch_fn, criterion), batch_fn(n) giving n samples"
            )
        criterion = made[2] if len(made) == 3 else None
        _probe_call(spec, made[0], made[1], criterion)
        return ModelSpec(lambda: factory()[0], made[1], criterion)
    raise EvendpError(
        f"{shown(spec)} returned {type(made).__name__}; expected an nn.Module with "
        "example_batch(n), (model, batch_fn) or (model, batch_fn, criterion)"
    )


def _no_factory(spec: str, module: Any) -> NoReturn:
    where, _, attr = spec.rpartition(":")
    names = sorted(
        name
        for name, value in vars(module).items()
        if callable(value) and not name.startswith("_") and value.__module__ == module.__name__
    )
    defined = ", ".join(names) or "no function or class"
    close = suggest(attr, names) or (names[0] if len(names) == 1 else None)
    fix = f"; did you mean --model {where}:{close}?" if close else ""
    raise EvendpError(f"--model {spec!r}: {where} has no {attr!r} (it defines: {defined}){fix}")


def load_module(spec: str, name: str) -> Any:
    """A dotted module (importable from the current folder, as under ``python -m``: the console
    script's ``sys.path[0]`` is its bin/), or a Python file loaded with its folder first on
    ``sys.path`` (as ``python models.py`` finds its imports)."""
    if not (name.endswith(".py") or os.sep in name or "/" in name):
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        return importlib.import_module(name)
    path = Path(name).expanduser().resolve()
    if not path.is_file():
        raise EvendpError(
            f"--model {spec!r}: no file {str(path)!r}; give a Python file and the factory in "
            "it, e.g. --model models.py:make_model, or a module: --model mypkg.models:make_model"
        )
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    # A stable, file-specific module name: pickling and dataclasses look modules up by name.
    module_name = f"evendp_user_model_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
    loaded = importlib.util.spec_from_file_location(module_name, path)
    if loaded is None or loaded.loader is None:
        raise EvendpError(f"--model {spec!r}: {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(loaded)
    sys.modules[module_name] = module
    try:
        loaded.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def _probe_call(
    spec: str, model: nn.Module, batch_fn: Callable[[int], Any], criterion: Any | None
) -> None:
    """One forward on fake tensors: a model and ``batch_fn`` that disagree get one line."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .._core._calls import call as _call

    with FakeTensorMode(allow_non_fake_inputs=True):
        try:
            batch = batch_fn(1)
        except Exception as exc:  # the user's batch_fn can raise anything
            raise EvendpError(
                f"--model {shown(spec)}: batch_fn(1) failed{raised_at(exc)}: "
                f"{type(exc).__name__}: {exc}"
            ) from None
        inputs = batch[0] if criterion is not None and isinstance(batch, (tuple, list)) else batch
        try:
            _call(model, inputs)
        except TypeError as exc:
            call = "model(batch)"
            if isinstance(inputs, dict):
                call = "model(**batch)"
            elif isinstance(inputs, (tuple, list)):
                call = "model(*batch)"
            raise EvendpError(
                f"--model {shown(spec)}: {type(model).__name__} was called as {call} with "
                f"{_describe(inputs)} from batch_fn(n) and raised TypeError: {exc}; batch_fn "
                "returns the model's inputs (a tensor: model(x); a tuple: model(*batch); a "
                "dict: model(**batch)); for targets, return (model, batch_fn, criterion) with "
                "batch_fn returning (inputs, targets)"
            ) from None
        except Exception:  # other failures are the planner's to report, with its context
            return


def _describe(value: Any) -> str:
    """A short description of a batch: ``a tuple of 2 tensors [1, 64], [1]``."""
    import torch

    if isinstance(value, torch.Tensor):
        return f"a tensor {list(value.shape)}"
    if isinstance(value, dict):
        return f"a dict with keys {sorted(value)}"
    if isinstance(value, (tuple, list)):
        shapes = ", ".join(
            str(list(v.shape)) if isinstance(v, torch.Tensor) else type(v).__name__ for v in value
        )
        return f"a {type(value).__name__} of {len(value)} tensors {shapes}"
    return f"a {type(value).__name__}"
