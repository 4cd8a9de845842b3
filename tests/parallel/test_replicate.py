"""Replicas share gradients with the original; threads keep the caller's torch state."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from evendp._parallel._replicate import parallel_apply, replicate

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


# --- GPU paths, checked without a GPU ----------------------------------------------------------


def test_a_single_replica_enters_its_device_and_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    # weights [0, 1] or device_ids=[1]: the one active replica runs in the caller's thread,
    # whose current device is cuda:0; allocations inside forward must land on cuda:1.
    entered: list[tuple[str, object]] = []

    @contextlib.contextmanager
    def device(d: torch.device) -> Iterator[None]:
        entered.append(("device", d))
        yield
        entered.append(("left", d))

    @contextlib.contextmanager
    def stream(s: object) -> Iterator[None]:
        entered.append(("stream", s))
        yield

    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: f"stream of {d}")
    monkeypatch.setattr(torch.cuda, "device", device)
    monkeypatch.setattr(torch.cuda, "stream", stream)
    seen: list[list[tuple[str, object]]] = []

    class Probe(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(list(entered))
            return x

    cuda1 = torch.device("cuda", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # autocast("cuda") on a CPU-only build
        parallel_apply([Probe()], [((torch.ones(1),), {})], [cuda1])
    assert seen == [[("device", cuda1), ("stream", "stream of cuda:1")]]
    assert entered[-1] == ("left", cuda1)


CUDA = [torch.device("cuda", i) for i in range(3)]


@pytest.mark.parametrize(
    ("param_devices", "devices", "expected"),
    [
        ([CUDA[0]], CUDA[1:], CUDA),  # distinct GPUs: one broadcast from the source
        ([CUDA[0]], CUDA[:2], CUDA[:2]),  # the source among the targets: no copy to itself
        ([CUDA[0]], [CUDA[1], CUDA[1]], None),  # virtual devices keep param.to()
        ([CUDA[0]], [CUDA[0]], None),  # nothing to copy
        ([CUDA[0]], [CUDA[1], CPU], None),  # a CPU target
        ([CPU], [CPU, CPU], None),
        ([CUDA[0], CUDA[1]], [CUDA[2]], None),  # parameters on two GPUs already
    ],
)
def test_which_device_sets_get_a_coalesced_broadcast(
    param_devices: list[torch.device], devices: list[torch.device], expected: object
) -> None:
    from evendp._parallel._replicate import _broadcast_targets

    assert _broadcast_targets(param_devices, devices) == expected


@pytest.mark.parametrize("detach", [False, True])
def test_replicate_uses_the_broadcast_copies_for_every_parameter(
    monkeypatch: pytest.MonkeyPatch, detach: bool
) -> None:
    # No second GPU here: the decision is forced for CPU "GPUs" and the broadcast is a fake
    # that records its call and returns marked copies; replicas must use exactly those.
    import evendp._parallel._replicate as mod

    calls: list[tuple[list[torch.device], int, bool]] = []
    made: dict[int, torch.Tensor] = {}

    def broadcast(params: list[torch.Tensor], targets: list[torch.device], d: bool) -> Any:
        calls.append((targets, len(params), d))
        out = [[p.detach().clone() for p in params] for _ in targets]
        made.update({id(c): c for c in out[1]})
        return out

    monkeypatch.setattr(mod, "_broadcast_targets", lambda ps, ds: [CPU, CPU], raising=False)
    monkeypatch.setattr(mod, "_broadcast", broadcast, raising=False)
    net = Tied()
    net.norm = nn.BatchNorm1d(4)
    [replica] = replicate(net, [CPU], detach=detach)
    assert calls == [([CPU, CPU], 3, detach)]  # the tied weight once, BatchNorm's two
    for name in ("embed.weight", "norm.weight", "norm.bias"):
        assert id(_get(replica, name)) in made
    assert replica.head.weight is replica.embed.weight  # still tied
    assert replica.norm.running_mean is not net.norm.running_mean  # buffers as before


def _get(module: nn.Module, dotted: str) -> torch.Tensor:
    owner, attr = dotted.rsplit(".", 1)
    value = getattr(module.get_submodule(owner), attr)
    assert isinstance(value, torch.Tensor)
    return value
