"""The Trainer puts the model on its first device itself and refuses a model on ``meta``, which
has nothing to move. The move a GPU run makes (cpu -> cuda:0, the parameters kept, then
trained) is tests/test_gpu_tier.py's: this machine has one real device, so here the move
goes to ``meta``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evendp import EvendpError, TrainConfig, Trainer
from evendp._training._strategies._base import place_model


def _net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def test_a_model_off_the_device_is_moved_there_in_place_and_said(
    capsys: pytest.CaptureFixture[str],
) -> None:
    net = _net()
    place_model(net, torch.device("meta"), "device_ids[0]")
    assert {t.device.type for t in net.state_dict().values()} == {"meta"}  # buffers too
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["evendp: the model was on cpu; moved it to meta (device_ids[0])"]
    place_model(net, torch.device("meta"), "device_ids[0]")  # already there: nothing said
    assert capsys.readouterr().err == ""


def test_a_model_already_on_its_device_is_left_alone(capsys: pytest.CaptureFixture[str]) -> None:
    net = _net()
    where = [t.data_ptr() for t in net.state_dict().values()]
    place_model(net, torch.device("cpu"), "device_ids[0]")
    assert [t.data_ptr() for t in net.state_dict().values()] == where
    assert capsys.readouterr().err == ""


def test_the_trainer_refuses_a_model_on_meta_in_one_line_with_the_fix() -> None:
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    with torch.device("meta"):
        net = _net()
    cfg = TrainConfig(steps=1, batch_size=4, progress=False)
    with pytest.raises(EvendpError) as info:
        Trainer(net, data, cfg, device_ids=["cpu", "cpu"], loss_fn=lambda m, b: m(b[0]).mean())
    message = str(info.value)
    assert "\n" not in message
    assert "on the meta device" in message and "device_ids[0]" in message
    assert "model.to_empty(device='cpu') then model.load_state_dict" in message
