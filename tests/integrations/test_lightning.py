"""Lightning DDP on 2 gloo ranks started by ``evendp launch --batch-sizes 1,3``, accumulation 2.

The ranks run tests/integrations/_lightning_script.py through the real launcher and torchrun
(in the launch conftest.py shares with test_ports.py);
the tests compare their batches with each rank's ``UnevenBatchSampler`` and their parameters
with one process training on the same accumulation windows.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

import evendp
from tests._helpers import require
from tests.integrations._tiny import (
    ACCUM,
    EPOCHS,
    LR,
    SAMPLES,
    SEED,
    reference_run,
    reference_update_error,
)

pytestmark = pytest.mark.multiprocess
require("lightning")

SIZES = [1, 3]
TOL = 1e-5


@pytest.fixture(scope="module")
def ranks(launched: Path) -> list[dict[str, Any]]:
    """The ranks' results (conftest.py's shared launch runs _lightning_script.main)."""
    return [torch.load(launched / f"rank{r}.pt", weights_only=False) for r in range(2)]


def test_each_rank_gets_exactly_its_own_batches(ranks: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(ranks):
        assert result["world"] == 2
        sampler = evendp.UnevenBatchSampler(SAMPLES, SIZES, rank=rank, seed=SEED)
        assert len(result["seen"]) == EPOCHS
        for epoch, batches in enumerate(result["seen"]):
            sampler.set_epoch(epoch)
            assert batches == list(sampler)


def test_parameters_equal_one_process_with_accumulation(ranks: list[dict[str, Any]]) -> None:
    seen = [r["seen"] for r in ranks]
    for result in ranks:
        assert reference_update_error(seen, result["params"]) < TOL


@pytest.mark.parametrize(
    ("run", "sizes", "samples"), [("mean", SIZES, 9), ("zero", [0, 4], SAMPLES)]
)
def test_a_mean_loss_and_empty_shares_equal_one_process(
    ranks: list[dict[str, Any]], run: str, sizes: list[int], samples: int
) -> None:
    """training_step returns the usual mean; a rank with nothing runs a stand-in of weight 0."""
    seen = [r[run]["seen"] for r in ranks]
    for rank, result in enumerate(ranks):
        sampler = evendp.UnevenBatchSampler(samples, sizes, rank=rank, seed=SEED)
        for epoch, batches in enumerate(result[run]["seen"]):
            sampler.set_epoch(epoch)
            assert batches == list(sampler)
        assert reference_update_error(seen, result[run]["params"]) < TOL
    assert any([] in r[run]["seen"][0] for r in ranks)  # an empty share ran, as a stand-in
    _, losses = reference_run(seen)
    for result in ranks:  # the logged loss is the global batch's mean, on every rank
        assert result[run]["loss"] == pytest.approx(losses[-1], rel=1e-5)


def test_the_sum_default_warns_that_it_becomes_the_mean() -> None:
    from evendp.integrations.lightning import UnevenGradient

    with pytest.warns(DeprecationWarning, match="becomes 'mean'"):
        assert UnevenGradient().reduction == "sum"
    with pytest.raises(evendp.EvendpError, match="'mean' or 'sum'"):
        UnevenGradient(reduction="avg")


def test_the_schedule_and_the_validation_loss_are_one_processs(
    ranks: list[dict[str, Any]],
) -> None:
    """Issue 36: ``estimated_stepping_batches`` (from the loader's length) is the run's number
    of optimizer steps, so a schedule over it ends at the last step; the validation loss
    logged with ``logged_count`` is the mean over the 9 rows (5 a step, the short last step
    leaves rank 0 a stand-in), whatever each rank held."""
    steps = EPOCHS * math.ceil(math.ceil(SAMPLES / sum(SIZES)) / ACCUM)  # one process's
    for result in ranks:
        got = result["scheduled"]
        assert got["estimated"] == len(got["lrs"]) == steps
        assert got["lrs"] == pytest.approx([LR * (1 - k / steps) for k in range(steps)])
        assert got["val_loss"] == pytest.approx(got["val_loss_of_every_row"], rel=1e-6)
