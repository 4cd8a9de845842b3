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


def test_the_default_reduction_is_the_mean_without_a_warning() -> None:
    """Issue 51: the default is ``"mean"`` (what ``training_step`` returns as users write
    it), with no deprecation shim while evendp is 0.x."""
    import warnings

    from evendp.integrations.lightning import UnevenGradient

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert UnevenGradient().reduction == "mean"
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


def _transformer_reference(clip: float | None, steps: int) -> tuple[list[Any], list[Any], Any]:
    """One process on transformer.py's global batches: (first step's gradients after
    clipping, final parameters, the trained model)."""
    import torch.nn.functional as F

    from tests.integrations import _lightning_script as script

    data, model = script.Blocks(), script.tiny_transformer()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    train = script.BLOCKS - script.VAL
    grads: list[torch.Tensor] = []
    done = 0
    for epoch in range(EPOCHS):
        samplers = [evendp.UnevenBatchSampler(train, SIZES, rank=r, seed=SEED) for r in (0, 1)]
        for sampler in samplers:
            sampler.set_epoch(epoch)
        for parts in zip(*samplers, strict=True):
            rows = [i for part in parts for i in part]
            inputs = torch.stack([data[i][0] for i in rows])
            target = torch.stack([data[i][1] for i in rows])
            F.nll_loss(model(inputs, target), target.view(-1)).backward()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if not grads:
                grads = [p.grad.detach().clone() for p in model.parameters()]
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if done == steps:
                return grads, [p.detach().clone() for p in model.parameters()], model
    return grads, [p.detach().clone() for p in model.parameters()], model


def _per_tensor(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return max(float((g - w).norm() / w.norm()) for g, w in zip(got, want, strict=True))


def test_loaders_built_in_main_train_like_one_process(launched: Path) -> None:
    """Issue 51: Lightning's transformer.py builds its loaders in main(), before fit starts
    the process group (it crashed on both ranks: "got 2 batch sizes [1, 3] for
    world_size=1"). Ported, on [1, 3] with gradient_clip_val=0.25: the first step's
    gradient of every tensor, clipped or not, is one process's to fp32 round-off, so are the
    final weights, the logged train_loss keeps the script's name and val_loss is the mean
    over every validation row."""
    import torch.nn.functional as F

    from tests.integrations import _lightning_script as script

    ranks = [torch.load(launched / f"transformer{r}.pt", weights_only=False) for r in (0, 1)]
    steps = EPOCHS * 2  # 8 training blocks, 4 a step
    want_clip, want_params, model = _transformer_reference(script.CLIP, steps)
    want_free, _, _ = _transformer_reference(None, 1)
    data = script.Blocks()
    val = [data[i] for i in range(script.BLOCKS - script.VAL, script.BLOCKS)]
    with torch.no_grad():
        inputs, target = torch.stack([v[0] for v in val]), torch.stack([v[1] for v in val])
        val_loss = float(F.nll_loss(model(inputs, target), target.view(-1)))
    for result in ranks:
        assert _per_tensor(result["clip"]["grads"], want_clip) < 1e-5
        assert _per_tensor(result["free"]["grads"], want_free) < 1e-5
        assert _per_tensor(result["clip"]["params"], want_params) < 1e-5
        assert "train_loss" in result["clip"]["names"]
        assert result["clip"]["val_loss"] == pytest.approx(val_loss, rel=1e-5)


def test_a_loader_built_before_the_group_takes_the_launchers_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 51: without a process group the rank and world come from torchrun's variables
    (it was rank 0 of world 1, and EVENDP_BATCH_SIZES=1,3 was refused)."""
    from evendp.integrations.lightning import uneven_dataloader

    monkeypatch.setenv("EVENDP_BATCH_SIZES", "1,3")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = uneven_dataloader(torch.utils.data.TensorDataset(torch.arange(8.0)), seed=SEED)
    want = list(evendp.UnevenBatchSampler(8, SIZES, rank=1, seed=SEED))
    assert [b[0].long().tolist() for b in loader] == want
