"""One home for the defaults that ``TrainConfig`` and ``evendp train`` share (issue 36).

Both read these names: ``TrainConfig``'s fields and the command line's options (declared
without importing torch: this module needs the standard library only). Two defaults
differed; each moves to the one value below in evendp
:data:`~evendp._core._deprecation.REMOVAL`, and until then the surface that changes says so
where the change would matter:

* ``LR``: ``TrainConfig``'s (torch's ``AdamW`` default). ``evendp train`` ran 3e-3
  (``CLI_LR_UNTIL_REMOVAL``); a run without ``--lr`` says it will be 1e-3.
* ``CHECKPOINT_EVERY``: ``evendp train``'s. ``TrainConfig`` saved only at the end
  (``CONFIG_CHECKPOINT_EVERY_UNTIL_REMOVAL``); one with an ``out_dir`` and no
  ``checkpoint_every`` warns that it will save every 50 steps.
"""

from __future__ import annotations

from typing import Any

from ._deprecation import REMOVAL

__all__ = [
    "BATCH",
    "CHECKPOINT_EVERY",
    "CLI_LR_UNTIL_REMOVAL",
    "COMM_TIMEOUT_S",
    "CONFIG_CHECKPOINT_EVERY_UNTIL_REMOVAL",
    "LR",
    "MIN_COMM_TIMEOUT_S",
    "NotGiven",
    "SEED",
    "STEPS",
    "checkpoint_every_note",
    "lr_note",
    "rate_text",
]

STEPS = 100  # optimizer steps
BATCH = 32  # samples per optimizer step, over all devices and ranks
SEED = 0
LR = 1e-3  # AdamW's learning rate
CHECKPOINT_EVERY = 50  # steps between checkpoints, where there is a folder to save in
COMM_TIMEOUT_S = 600.0  # seconds a collective waits for the other ranks once training runs
MIN_COMM_TIMEOUT_S = 5.0

CLI_LR_UNTIL_REMOVAL = 3e-3
CONFIG_CHECKPOINT_EVERY_UNTIL_REMOVAL = 0


class NotGiven(int):
    """A default nobody passed (``TrainConfig.batch_size``, ``checkpoint_every``). It is the
    int it holds everywhere (arithmetic, ``repr``, JSON, pickling as a plain ``int``); only
    an ``isinstance`` check tells it apart (``global_batch_size``: so that
    ``dataclasses.replace(config, batch_sizes=...)`` derives the sum again instead of calling
    the old one a contradiction).

    >>> NotGiven(32) == 32, isinstance(NotGiven(32), NotGiven), repr(NotGiven(0))
    (True, True, '0')
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return int.__repr__(self)

    def __reduce__(self) -> tuple[Any, ...]:
        return (int, (int(self),))


def rate_text(rate: float) -> str:
    """A learning rate as people write it.

    >>> rate_text(3e-3), rate_text(0.1)
    ('3e-3', '1e-1')
    """
    return f"{rate:.0e}".replace("e-0", "e-").replace("e+0", "e")


def lr_note() -> str:
    """What ``evendp train`` says when ``--lr`` is not given.

    >>> lr_note()[:50]
    "--lr not given: 3e-3, evendp train's default until"
    """
    return (
        f"--lr not given: {rate_text(CLI_LR_UNTIL_REMOVAL)}, evendp train's default until "
        f"evendp {REMOVAL}, then {rate_text(LR)} (TrainConfig's, torch's AdamW's); pass --lr "
        "to choose"
    )


def checkpoint_every_note() -> str:
    """What ``TrainConfig(out_dir=...)`` without ``checkpoint_every`` warns.

    >>> checkpoint_every_note()[:60]
    'TrainConfig(out_dir=...) without checkpoint_every saves only'
    """
    return (
        "TrainConfig(out_dir=...) without checkpoint_every saves only at the end and on "
        f"Ctrl-C; from evendp {REMOVAL} it saves every {CHECKPOINT_EVERY} steps, as evendp "
        f"train does. Pass checkpoint_every={CONFIG_CHECKPOINT_EVERY_UNTIL_REMOVAL} to keep "
        f"this, or {CHECKPOINT_EVERY}"
    )
