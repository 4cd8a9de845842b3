"""The error family by kind: bad input is a ValueError (exit 2), a failed run is not (exit 1)."""

from __future__ import annotations

import pickle

import pytest

import evendp
from evendp._distributed._run_files import RunFilesUnsafe
from evendp._distributed._run_lock import RunDirBusy
from evendp._distributed._stalled import RankStalled
from evendp._training._checkpoint import CorruptCheckpoint

INPUT = [
    evendp.InputError,
    evendp.PlanError,
    evendp.CheckpointError,
    evendp.LiveMemoryError,
    CorruptCheckpoint,
    RunDirBusy,
    RunFilesUnsafe,
]
FAULTS = [evendp.TrainingError, RankStalled]


@pytest.mark.parametrize("kind", INPUT + FAULTS)
def test_every_error_is_an_evendp_error(kind: type) -> None:
    assert issubclass(kind, evendp.EvendpError)


@pytest.mark.parametrize("kind", INPUT)
def test_bad_input_is_a_value_error_and_exits_2(kind: type) -> None:
    assert issubclass(kind, ValueError) and issubclass(kind, evendp.InputError)
    assert kind.exit_code == 2


@pytest.mark.parametrize("kind", FAULTS)
def test_a_failed_run_is_not_a_value_error_and_exits_1(kind: type) -> None:
    assert not issubclass(kind, ValueError)
    assert kind.exit_code == 1


def test_the_root_raised_as_itself_is_bad_input() -> None:
    """The ~290 ``raise EvendpError(...)`` sites stay bad input, caught as ValueError."""
    with pytest.raises(ValueError, match="lr='fast'") as caught:
        raise evendp.EvendpError("lr='fast' is not a number; pass e.g. lr=3e-4")
    assert type(caught.value) is evendp.InputError
    assert caught.value.args == ("lr='fast' is not a number; pass e.g. lr=3e-4",)


def test_a_real_bad_input_is_caught_both_ways() -> None:
    with pytest.raises(ValueError):
        evendp.parse_batch_sizes("3,x")
    with pytest.raises(evendp.EvendpError):
        evendp.parse_batch_sizes("3,x")


def test_a_training_error_escapes_except_value_error() -> None:
    with pytest.raises(evendp.TrainingError):
        try:
            raise evendp.TrainingError("the loss was NaN in 3 steps in a row")
        except ValueError:  # pragma: no cover (the bug this test guards against)
            pytest.fail("a run-time fault was caught as bad input")


@pytest.mark.parametrize(
    "error",
    [
        evendp.EvendpError("bad"),
        evendp.PlanError("no plan"),
        evendp.LiveMemoryError("no NVIDIA driver"),
        evendp.TrainingError("disk full"),
    ],
)
def test_errors_cross_processes_whole(error: Exception) -> None:
    """Ranks exchange errors by pickling (``_rank_errors``): type and message survive."""
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)


def test_a_subclass_defined_elsewhere_keeps_its_own_type() -> None:
    class Mine(evendp.EvendpError):
        pass

    assert type(Mine("x")) is Mine and not isinstance(Mine("x"), ValueError)
