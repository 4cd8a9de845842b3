"""One home for the defaults that ``TrainConfig`` and the command line share (issues 36, 51).

Every surface reads these names: ``TrainConfig``'s fields, ``evendp train``'s options and
``evendp launch``'s ``--batch`` (declared without importing torch: this module needs the
standard library only). One value per option, the same everywhere.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BALANCES",
    "BATCH",
    "CHECKPOINT_EVERY",
    "COMM_TIMEOUT_S",
    "LR",
    "MIN_COMM_TIMEOUT_S",
    "NotGiven",
    "SEED",
    "STEPS",
    "rate_text",
]

STEPS = 100  # optimizer steps
BATCH = 32  # samples per optimizer step, over all devices and ranks
SEED = 0
LR = 1e-3  # torch's AdamW default
CHECKPOINT_EVERY = 50  # steps between checkpoints, where there is a folder to save in
COMM_TIMEOUT_S = 600.0  # seconds a collective waits for the other ranks once training runs
MIN_COMM_TIMEOUT_S = 5.0
# The balance modes of TrainConfig.balance, UnevenTrainer and --balance; "none" is the default.
BALANCES = ("none", "speed")


class NotGiven(int):
    """A default nobody passed (``TrainConfig.batch_size``, ``checkpoint_every``). It is the
    int it holds everywhere (arithmetic, ``repr``, JSON, pickling as a plain ``int``); only
    an ``isinstance`` check tells it apart (``global_batch_size``: so that
    ``dataclasses.replace(config, batch_sizes=...)`` derives the sum again instead of calling
    the old one a contradiction; ``checkpoint_every``: the default needs no ``out_dir``, a
    given one does).

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
