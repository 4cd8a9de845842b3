"""Trainer callbacks: objects whose optional ``on_*`` methods the training loop calls.

The hook points, in the order a run meets them (every method is optional; a callback need not
subclass :class:`Callback`, any object with some of these methods works, as in Lightning's and
Hugging Face's callback designs):

- ``on_fit_start(trainer)``: before the first step of a ``fit`` call;
- ``on_step_end(trainer, step)``: after every optimizer step (``step`` is 1-based, the run's
  position), cheap: nothing is read from the device for it;
- ``on_log(trainer, step, metrics)``: every ``config.log_every`` steps, the first step and the
  last (the steps the progress bar reads the loss on), with ``{"loss": ..., "lr": ...}`` and,
  where a device's peak memory is known, ``"memory/<device>"`` in bytes; a skipped step has no
  ``"loss"``;
- ``on_eval(trainer, step, metrics)``: after each evaluation of ``eval_data``;
- ``on_save(trainer, step, path)``: after each checkpoint (``path`` is ``None`` on ranks > 0);
- ``on_fit_end(trainer, report)``: after the last step, with the :class:`TrainReport`.

Under ``torchrun`` every rank runs its own callbacks' hooks. Reading the loss for ``on_log`` is
a collective: the ranks agree at the start of ``fit`` whether any has callbacks, so callbacks
on rank 0 alone are fine. The shipped loggers write on rank 0 only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .._core._errors import EvendpError

__all__ = ["HOOKS", "Callback", "Callbacks"]

HOOKS = ("on_fit_start", "on_step_end", "on_log", "on_eval", "on_save", "on_fit_end")


class Callback:
    """A base class whose hooks do nothing: subclass it and override the ones you need.

    >>> import torch
    >>> from evendp import TrainConfig, Trainer
    >>> class Losses(Callback):
    ...     def __init__(self):
    ...         self.seen = []
    ...     def on_log(self, trainer, step, metrics):
    ...         self.seen.append((step, round(metrics["loss"], 1)))
    >>> data = torch.utils.data.TensorDataset(torch.ones(8, 2), torch.zeros(8))
    >>> net = torch.nn.Linear(2, 1)
    >>> loss = lambda m, b: ((m(b[0]).squeeze(1) - b[1]) ** 2).mean()
    >>> cfg = TrainConfig(steps=3, batch_size=4, lr=0.0, progress=False, log_every=2)
    >>> torch.manual_seed(0) and None
    >>> logged = Losses()
    >>> _ = Trainer(net, data, cfg, loss_fn=loss, callbacks=[logged]).fit()
    >>> [step for step, _ in logged.seen]  # the first step, every 2nd, the last
    [1, 2, 3]
    """

    def on_fit_start(self, trainer: Any) -> None:
        """Before the first step of ``fit``."""

    def on_step_end(self, trainer: Any, step: int) -> None:
        """After every optimizer step."""

    def on_log(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """On the steps whose loss is read (``config.log_every``)."""

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        """After each evaluation of ``eval_data``."""

    def on_save(self, trainer: Any, step: int, path: Any) -> None:
        """After each checkpoint."""

    def on_fit_end(self, trainer: Any, report: Any) -> None:
        """After the run, with its report."""


class Callbacks:
    """The Trainer's callbacks, called in the order given; a missing method is skipped.

    >>> class Printer:
    ...     def on_step_end(self, trainer, step):
    ...         print("step", step)
    >>> hooks = Callbacks([Printer()])
    >>> hooks.call("on_step_end", None, 3)
    step 3
    >>> hooks.call("on_log", None, 3, {})  # Printer has no on_log: nothing happens
    >>> bool(hooks), bool(Callbacks(None))
    (True, False)
    """

    def __init__(self, callbacks: Sequence[Any] | None) -> None:
        self.items = _validate_callbacks(callbacks)

    def __bool__(self) -> bool:
        return bool(self.items)

    def call(self, hook: str, *args: Any) -> None:
        """``callback.hook(*args)`` for every callback that has ``hook``."""
        for callback in self.items:
            method = getattr(callback, hook, None)
            if method is not None:
                method(*args)


def _validate_callbacks(callbacks: Sequence[Any] | None) -> list[Any]:
    if callbacks is None:
        return []
    if not isinstance(callbacks, (list, tuple)):
        raise EvendpError(
            f"callbacks must be a list of callback objects, got {type(callbacks).__name__}; "
            "e.g. callbacks=[TensorBoardLogger('runs/tb')]"
        )
    for c in callbacks:
        if not any(callable(getattr(c, h, None)) for h in HOOKS):
            raise EvendpError(
                f"callbacks: {c!r} has none of the hooks {', '.join(HOOKS)}; pass an object "
                "with some of these methods, e.g. a subclass of evendp.Callback or a logger "
                "such as evendp.CSVLogger('metrics.csv')"
            )
    return list(callbacks)
