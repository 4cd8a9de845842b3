"""Replicas share gradients with the original; threads keep the caller's torch state."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evendp._replicate import parallel_apply, replicate

CPU = torch.device("cpu")


def test_replica_gradients_accumulate_into_the_original_parameters() -> None:
    net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    replicas = replicate(net, [CPU, CPU], detach=False)
    x = torch.randn(6, 3)
    sum(r(x[i * 3 : (i + 1) * 3]).sum() for i, r in enumerate(replicas)).backward()
    expected = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    expected.load_state_dict(net.state_dict())
    expected(x).sum().backward()
    for p, q in zip(net.parameters(), expected.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad)


def test_replicas_have_no_parameters_of_their_own_and_copied_buffers() -> None:
    net = nn.BatchNorm1d(3)
    [replica] = replicate(net, [CPU], detach=True)
    assert list(replica.parameters()) == []
    assert replica.running_mean is not net.running_mean
    torch.testing.assert_close(replica.running_mean, net.running_mean)
    assert not replica.weight.requires_grad  # detached under no_grad use


class Probe(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[bool, torch.dtype]:
        return torch.is_grad_enabled(), (x @ x.T).dtype


def test_threads_inherit_grad_mode_and_autocast() -> None:
    shards = [((torch.randn(2, 4),), {})] * 2
    with torch.no_grad():
        outs = parallel_apply([Probe(), Probe()], shards, [CPU, CPU])
    assert [grad for grad, _ in outs] == [False, False]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = parallel_apply([Probe(), Probe()], shards, [CPU, CPU])
    assert [dtype for _, dtype in outs] == [torch.bfloat16, torch.bfloat16]


def test_the_first_failing_replica_is_reported_with_its_device() -> None:
    class Boom(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("boom")

    with pytest.raises(KeyError) as info:
        parallel_apply([nn.Identity(), Boom()], [((torch.ones(1),), {})] * 2, [CPU, CPU])
    assert "replica 1" in info.value.__notes__[0]


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight  # tied, as in GPT-2 style models


def test_a_tied_parameter_is_copied_once_per_replica() -> None:
    [replica] = replicate(Tied(), [CPU], detach=True)  # detach makes a new tensor per copy
    assert replica.head.weight is replica.embed.weight
