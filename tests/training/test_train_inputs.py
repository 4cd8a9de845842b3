"""Issue 22's list of bad Python inputs, each refused at the boundary with an ``EvendpError``
naming the argument, what it got and what it takes (before: NaN training, -0.0 losses,
AttributeErrors or torch internals deep in ``fit``)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from evendp import EvendpError, TrainConfig, Trainer, ddp_loss, global_count
from tests.test_public_inputs import _Pairs, _Regress


def _fit(config: TrainConfig | None = None, **kwargs: Any) -> Any:
    config = config or TrainConfig(steps=2, batch_size=4, progress=False)
    model = kwargs.pop("model", _Regress())
    return Trainer(model, _Pairs(), config, device_ids=["cpu", "cpu"], **kwargs)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"grad_clip": float("nan")}, r"grad_clip must be a finite number > 0 or None, got nan"),
        ({"checkpoint_every": 1.5}, r"checkpoint_every must be a non-negative int, got 1.5"),
        ({"checkpoint_every": "2"}, r"checkpoint_every must be a non-negative int, got '2'"),
        ({"batch_sizes": "3,5"}, r"batch_sizes must be a list of ints >= 0 or None, got '3,5'"),
        ({"lr": "fast"}, r"lr must be a finite number >= 0, got 'fast'"),
        ({"weight_decay": "x"}, r"weight_decay must be a finite number >= 0, got 'x'"),
        ({"seed": "zero"}, r"seed must be an int, got 'zero'"),
        ({"out_dir": 123}, r"out_dir must be a path \(str or pathlib.Path\) or None, got 123"),
        ({"progress": "no"}, r"progress must be True or False, got 'no'"),
    ],
)  # fmt: skip
def test_train_config_refuses_at_construction(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(EvendpError, match=message):
        TrainConfig(**fields)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"config": {"steps": 2}}, r"config must be a TrainConfig, got dict; e.g. TrainConfig"),
        ({"model": None}, r"model must be an nn.Module .*, got None"),
        ({"model": nn.ReLU()}, r"model \(ReLU\) has no parameters to train"),
        ({"optimizer": "adam"}, r"optimizer must be a torch.optim.Optimizer .*, got 'adam'"),
        ({"loss_fn": "mse"}, r"loss_fn must be a function \(model, batch\) -> mean loss"),
        ({"count_fn": 3}, r"count_fn must be a function batch -> counted items or None"),
        ({"weights": "2,1"}, r"weights must be a list of finite numbers >= 0"),
        ({"device_ids": "cpu,cpu"}, r"device_ids must be a list of devices"),
    ],
)
def test_trainer_refuses_at_construction(kwargs: dict[str, Any], message: str) -> None:
    config = kwargs.pop("config", TrainConfig(steps=1, batch_size=4, progress=False))
    model = kwargs.pop("model", _Regress())
    with pytest.raises(EvendpError, match=message):
        Trainer(model, _Pairs(), config, **{"device_ids": ["cpu", "cpu"], **kwargs})


def test_a_batch_larger_than_the_dataset_is_refused() -> None:
    # Before: every step silently trained the 12 samples there are, not the 64 asked for.
    with pytest.raises(EvendpError, match=r"batch_size=64 is larger than the dataset \(12"):
        _fit(TrainConfig(steps=1, batch_size=64, progress=False))


def test_batch_sizes_in_one_process_warn_that_they_are_unused() -> None:
    config = TrainConfig(steps=1, batch_size=4, batch_sizes=[3, 1], progress=False)
    with pytest.warns(UserWarning, match=r"batch_sizes=\[3, 1\] is ignored in one process"):
        _fit(config)


def test_batch_sizes_alone_set_the_global_batch_in_one_process_too() -> None:
    # Before: batch_size stayed 32 (the default) while torchrun trained 4 a step; one
    # process now trains the same global batch as the ranks would.
    config = TrainConfig(steps=1, batch_sizes=[3, 1], progress=False)
    assert config.batch_size == 4
    with pytest.warns(UserWarning, match=r"the global batch, batch_size=4, is split"):
        trainer = _fit(config)
    assert trainer.sampler.batch_sizes == [4]


def test_batch_sizes_are_checked_as_one_plan() -> None:
    with pytest.raises(EvendpError, match=r"batch_sizes: all batch sizes are zero"):
        TrainConfig(batch_sizes=[0, 0])


def test_a_negative_count_fn_result_stops_the_first_step() -> None:
    # Before: loss -0.0 and no learning.
    trainer = _fit(count_fn=lambda batch: -1)
    with pytest.raises(EvendpError, match=r"count_fn\(batch\) must be a whole number >= 0"):
        trainer.fit()


@pytest.mark.parametrize("count", [float("nan"), 2.5, torch.tensor(float("inf"))])
def test_count_fn_results_must_be_whole_finite_numbers(count: Any) -> None:
    trainer = _fit(count_fn=lambda batch: count)
    with pytest.raises(EvendpError, match=r"count_fn\(batch\)"):
        trainer.fit()


def test_a_loss_fn_returning_a_vector_is_refused() -> None:
    def per_sample(model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return ((model.lin(x) - y) ** 2).mean(dim=1)  # (samples,): not reduced

    trainer = _fit(loss_fn=per_sample)
    with pytest.raises(EvendpError, match=r"loss_fn must return .* 0-dim tensor, got shape"):
        trainer.fit()


def test_ddp_loss_refuses_nan_and_negative_tensor_counts() -> None:
    s = torch.tensor(3.0, requires_grad=True)
    with pytest.raises(EvendpError, match=r"global_count must be a finite number >= 0.*nan"):
        ddp_loss(s, 3, torch.tensor(float("nan")))
    with pytest.raises(EvendpError, match=r"global_count must be a finite number >= 0.*-2"):
        ddp_loss(s, 3, torch.tensor(-2.0))
    with pytest.raises(EvendpError, match=r"local_count must be a finite number >= 0"):
        ddp_loss(s, torch.tensor(float("inf")))
    with pytest.raises(EvendpError, match=r"local_count must be >= 0"):
        global_count(float("nan"))
    with pytest.raises(EvendpError, match=r"device must be a torch.device"):
        global_count(3, device="gpu0")


def test_valid_inputs_still_train() -> None:
    # The checks refuse only what is wrong: a Path, numpy-free ints, a tensor count.
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        report = _fit(count_fn=lambda batch: torch.tensor(float(len(batch[0])))).fit()
    assert report.steps == 2 and all(torch.isfinite(torch.tensor(report.losses)))
