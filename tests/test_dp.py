"""BalancedDataParallel on virtual CPU devices: exactness, inputs, outputs, state dicts, errors."""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from evendp import BalancedDataParallel, EvendpError, ParallelCriterion, Scattered, gather
from tests._helpers import requires_cuda

# ---------------------------------------------------------------- models for the property tests


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 5) -> (B, 3)
        out: torch.Tensor = self.net(x)
        return out


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 2, 6, 6) -> (B, 3)
        h = torch.relu(self.conv(x)).mean(dim=(2, 3))
        out: torch.Tensor = self.head(h)
        return out


class TinyTransformerLM(nn.Module):
    """Computes its own mean cross-entropy inside forward: a scalar replica output."""

    def __init__(self, vocab: int = 11) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, vocab)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.block(self.embed(idx)))  # (B, T, vocab)
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _mlp_case(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return MLP(), (torch.randn(batch, 5), torch.randn(batch, 3))


def _conv_case(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return ConvNet(), (torch.randn(batch, 2, 6, 6), torch.randint(0, 3, (batch,)))


def _lm_case(batch: int) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return TinyTransformerLM(), (torch.randint(0, 11, (batch, 7)), torch.randint(0, 11, (batch, 7)))


def _reference(model: nn.Module, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss one device computes on the full batch."""
    if name == "lm":
        loss: torch.Tensor = model(x, y)
    elif name == "mlp":
        loss = nn.functional.mse_loss(model(x), y)
    else:
        loss = nn.functional.cross_entropy(model(x), y)
    return loss


def _balanced(
    wrapped: BalancedDataParallel, name: str, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    """The same loss through the wrapper: inside forward, gathered, or per device."""
    if name == "lm":
        return wrapped(x, y)
    if name == "mlp":
        return nn.functional.mse_loss(wrapped(x), y)
    wrapped.gather_output = False
    return ParallelCriterion(nn.CrossEntropyLoss())(wrapped(x), y)


CASES: dict[str, Callable[[int], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "mlp": _mlp_case,
    "conv": _conv_case,
    "lm": _lm_case,
}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


weights_strategy = st.integers(1, 4).flatmap(
    lambda k: st.lists(st.sampled_from([0, 0, 0.5, 1, 2, 3.5]), min_size=k, max_size=k).filter(
        lambda ws: sum(ws) > 0
    )
)


@settings(max_examples=25, deadline=None)
@given(
    name=st.sampled_from(sorted(CASES)),
    weights=weights_strategy,
    batch=st.integers(1, 13),
    seed=st.integers(0, 2**16),
)
def test_loss_and_gradient_equal_one_device_on_the_full_batch(
    name: str, weights: list[float], batch: int, seed: int
) -> None:
    torch.manual_seed(seed)
    model, (x, y) = CASES[name](batch)
    reference = copy.deepcopy(model)

    wrapped = BalancedDataParallel(model, ["cpu"] * len(weights), weights=weights)
    loss = _balanced(wrapped, name, x, y)
    loss.backward()
    ref_loss = _reference(reference, name, x, y)
    ref_loss.backward()

    assert sum(wrapped.last_sizes) == batch
    assert all(n == 0 for n, w in zip(wrapped.last_sizes, weights, strict=True) if w == 0)
    assert loss.dim() == 0
    assert _relative_error(loss.detach(), ref_loss.detach()) <= 1e-5
    for (pname, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad is not None, pname
        assert q.grad is not None
        assert _relative_error(p.grad, q.grad) <= 1e-5, pname


class PerSampleMean(nn.Module):
    """Returns the mean of the per-sample losses it is given: the source material's example."""

    def forward(self, per_sample_loss: torch.Tensor) -> torch.Tensor:
        return per_sample_loss.mean()


def test_losses_split_two_to_one_combine_to_the_true_mean_not_the_mean_of_means() -> None:
    losses = torch.tensor([0.3, 0.2, 0.8])
    wrapped = BalancedDataParallel(PerSampleMean(), ["cpu", "cpu"], weights=[2, 1])
    combined = wrapped(losses)
    assert wrapped.last_sizes == [2, 1]
    # The per-device means are 0.25 and 0.8: their plain mean would be 0.525.
    assert combined.item() == pytest.approx(0.4333333, abs=1e-6)


def test_scalar_output_is_the_same_on_one_device_and_many_without_gather_warning() -> None:
    losses = torch.rand(10)
    one = BalancedDataParallel(PerSampleMean(), ["cpu"])(losses)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        many = BalancedDataParallel(PerSampleMean(), ["cpu"] * 4, weights=[3, 0, 1, 2])(losses)
    assert one.dim() == many.dim() == 0
    assert many.item() == pytest.approx(one.item(), rel=1e-6)


class ThreadRecorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.threads: set[str] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.threads.add(threading.current_thread().name)
        out: torch.Tensor = self.linear(x)
        return out


def test_virtual_devices_run_replicas_in_threads_and_zero_weight_devices_get_none() -> None:
    recorder = ThreadRecorder()
    wrapped = BalancedDataParallel(recorder, ["cpu"] * 4, weights=[1, 0, 1, 1])
    wrapped(torch.randn(6, 2))
    # Replicas share the `threads` set (shallow copies): one entry per active device.
    assert len(recorder.threads) == 3
    assert wrapped.last_sizes == [2, 0, 2, 2]


def test_batch_smaller_than_the_device_count_uses_fewer_devices() -> None:
    net = nn.Linear(3, 1)
    wrapped = BalancedDataParallel(net, ["cpu"] * 4)
    x = torch.randn(2, 3)
    out = wrapped(x)
    assert wrapped.last_sizes == [1, 1, 0, 0]
    torch.testing.assert_close(out, net(x))


def test_weights_are_renormalized_for_every_batch() -> None:
    wrapped = BalancedDataParallel(nn.Linear(1, 1), ["cpu"] * 3, weights=[2, 1, 1])
    wrapped(torch.randn(8, 1))
    assert wrapped.last_sizes == [4, 2, 2]
    wrapped(torch.randn(5, 1))
    assert wrapped.last_sizes == [3, 1, 1]


# ---------------------------------------------------------------- structured inputs and outputs


class Pair(NamedTuple):
    a: torch.Tensor
    b: torch.Tensor


@dataclass
class Batch:
    features: torch.Tensor
    scale: float


class Structured(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)

    def forward(
        self, pair: Pair, inputs: dict[str, torch.Tensor], batch: Batch, *, tag: str, bias: float
    ) -> tuple[torch.Tensor, dict[str, object]]:
        h = self.linear(pair.a + pair.b + inputs["x"] + batch.features) * batch.scale + bias
        return h, {"tag": tag, "first": h[:, 0], "sum": h.sum()}


def test_structured_inputs_kwargs_and_outputs_round_trip() -> None:
    torch.manual_seed(1)
    model = Structured()
    tensors = [torch.randn(7, 3) for _ in range(3)]
    args = (Pair(tensors[0], tensors[1]), {"x": tensors[2]}, Batch(torch.randn(7, 3), 2.0))
    expected = model(*args, tag="t", bias=0.5)
    wrapped = BalancedDataParallel(model, ["cpu"] * 3, weights=[1, 2, 3])
    out, extra = wrapped(*args, tag="t", bias=0.5)
    torch.testing.assert_close(out, expected[0])
    assert extra["tag"] == "t"
    torch.testing.assert_close(extra["first"], expected[1]["first"])
    # A float scalar is combined as the sample-weighted mean of the per-device values: exact
    # for means (the promise); a per-device *sum* is averaged too, as documented.
    parts = [expected[0][:1], expected[0][1:3], expected[0][3:]]  # the split [1, 2, 4]
    weighted = sum(len(p) / 7 * p.sum() for p in parts)
    torch.testing.assert_close(extra["sum"], weighted)


def test_batch_tensors_that_disagree_name_both_sizes() -> None:
    wrapped = BalancedDataParallel(Structured(), ["cpu", "cpu"])
    pair = Pair(torch.randn(4, 3), torch.randn(5, 3))
    with pytest.raises(EvendpError, match=r"size 4.*size 5"):
        wrapped(pair, {"x": torch.randn(4, 3)}, Batch(torch.randn(4, 3), 1.0), tag="", bias=0.0)


def test_inputs_without_a_batch_tensor_are_refused() -> None:
    with pytest.raises(EvendpError, match="no tensor with a batch dimension"):
        BalancedDataParallel(nn.Identity(), ["cpu"])(3.0)


def test_gather_false_returns_scattered_and_gather_concatenates() -> None:
    net = nn.Linear(3, 2)
    wrapped = BalancedDataParallel(net, ["cpu"] * 3, weights=[0, 2, 1], gather_output=False)
    x = torch.randn(6, 3)
    parts = wrapped(x)
    assert isinstance(parts, Scattered)
    assert parts.sizes == [4, 2]
    assert [o.shape[0] for o in parts.outputs] == [4, 2]
    torch.testing.assert_close(gather(parts), net(x))


def test_parallel_criterion_sum_with_ignore_index_matches_the_true_mean() -> None:
    torch.manual_seed(2)
    net = nn.Linear(4, 5)
    x = torch.randn(9, 4)
    y = torch.tensor([0, -100, 2, 3, -100, -100, 1, 4, 2])
    wrapped = BalancedDataParallel(net, ["cpu"] * 3, weights=[3, 1, 2], gather_output=False)
    summed = ParallelCriterion(nn.CrossEntropyLoss(reduction="sum"), reduction="sum")
    loss = summed(wrapped(x), y) / (y != -100).sum()
    expected = nn.functional.cross_entropy(net(x), y, ignore_index=-100)
    torch.testing.assert_close(loss, expected)


def test_parallel_criterion_errors() -> None:
    wrapped = BalancedDataParallel(nn.Linear(2, 2), ["cpu", "cpu"], gather_output=False)
    parts = wrapped(torch.randn(4, 2))
    with pytest.raises(EvendpError, match=r"targets have 3 samples.*outputs have 4"):
        ParallelCriterion(nn.MSELoss())(parts, torch.randn(3, 2))
    with pytest.raises(EvendpError, match="expected the Scattered"):
        ParallelCriterion(nn.MSELoss())(torch.randn(4, 2), torch.randn(4, 2))
    with pytest.raises(EvendpError, match=r"shape \[2, 2\]"):
        ParallelCriterion(nn.MSELoss(reduction="none"))(parts, torch.randn(4, 2))
    with pytest.raises(EvendpError, match="reduction='avg'"):
        ParallelCriterion(nn.MSELoss(), reduction="avg")  # type: ignore[arg-type]


# ---------------------------------------------------------------- state dicts


def test_state_dict_has_the_module_keys_and_loads_both_forms() -> None:
    net = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    wrapped = BalancedDataParallel(net, ["cpu", "cpu"])
    state = wrapped.state_dict()
    assert set(state) == set(net.state_dict())

    other = BalancedDataParallel(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), ["cpu"])
    other.load_state_dict(state)
    torch.testing.assert_close(other.module[0].weight, net[0].weight)

    prefixed = {f"module.{k}": v.clone() + 1 for k, v in state.items()}
    other.load_state_dict(prefixed)
    torch.testing.assert_close(other.module[0].weight, net[0].weight + 1)

    # A plain module takes the wrapper's state dict unchanged.
    plain = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    plain.load_state_dict(wrapped.state_dict())
    torch.testing.assert_close(plain[0].weight, net[0].weight)


def test_a_bad_state_dict_still_fails_loudly() -> None:
    wrapped = BalancedDataParallel(nn.Linear(2, 3), ["cpu"])
    with pytest.raises(RuntimeError, match="weight"):
        wrapped.load_state_dict({"bias": torch.zeros(3)})


# ---------------------------------------------------------------- errors at the boundary


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"weights": [1, 1]}, "2 weights .* for 3 devices"),
        ({"weights": [1, 1, 1, 1]}, "4 weights .* for 3 devices"),
        ({"weights": [1, -2, 1]}, "-2 at position 1"),
        ({"weights": [0, 0, 0]}, "all weights are zero"),
        ({"dim": -1}, "dim must be a non-negative int"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(EvendpError, match=fragment):
        BalancedDataParallel(nn.Linear(1, 1), ["cpu"] * 3, **kwargs)  # type: ignore[arg-type]


def test_device_errors_say_how_to_fix_them() -> None:
    with pytest.raises(EvendpError, match=r"wrap it in a list"):
        BalancedDataParallel(nn.Linear(1, 1), "cpu")  # type: ignore[arg-type]
    with pytest.raises(EvendpError, match="is not a device"):
        BalancedDataParallel(nn.Linear(1, 1), ["gpu7"])
    with pytest.raises(EvendpError, match="at least one device"):
        BalancedDataParallel(nn.Linear(1, 1), [])
    if not torch.cuda.is_available():
        with pytest.raises(EvendpError, match=r"CUDA is not available.*\['cpu', 'cpu', 'cpu'\]"):
            BalancedDataParallel(nn.Linear(1, 1), [2, 3])


def test_a_module_off_the_first_device_is_refused_with_the_fix() -> None:
    on_meta = nn.Linear(2, 2, device="meta")
    with pytest.raises(EvendpError, match=r"module.to\('cpu'\).*CUDA_VISIBLE_DEVICES"):
        BalancedDataParallel(on_meta, ["cpu", "cpu"])


def test_a_module_moved_after_wrapping_is_caught_at_forward() -> None:
    wrapped = BalancedDataParallel(nn.Linear(2, 2), ["cpu", "cpu"])
    wrapped.module.to("meta")
    with pytest.raises(EvendpError, match="must sit on device_ids"):
        wrapped(torch.randn(2, 2))


class FailsAboveTwo(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 2:
            raise torch.OutOfMemoryError("simulated: share too large")
        return x


def test_out_of_memory_in_a_replica_thread_keeps_its_type() -> None:
    wrapped = BalancedDataParallel(FailsAboveTwo(), ["cpu", "cpu"], weights=[1, 3])
    with pytest.raises(torch.OutOfMemoryError) as info:
        wrapped(torch.randn(8))
    assert any("replica 1" in note for note in info.value.__notes__)
    assert info.value.evendp_device_index == 1  # type: ignore[attr-defined]


def test_out_of_memory_names_the_device_index_not_the_replica_index() -> None:
    # Device 0 has weight 0, so the failing replica 1 runs on device_ids[2].
    wrapped = BalancedDataParallel(FailsAboveTwo(), ["cpu"] * 3, weights=[0, 1, 3])
    with pytest.raises(torch.OutOfMemoryError) as info:
        wrapped(torch.randn(8))
    assert info.value.evendp_device_index == 2  # type: ignore[attr-defined]


def test_no_grad_forward_works_and_builds_no_graph() -> None:
    wrapped = BalancedDataParallel(nn.Linear(3, 1), ["cpu", "cpu", "cpu"])
    x = torch.randn(5, 3)
    with torch.no_grad():
        out = wrapped(x)
        # The final concatenation runs under no_grad anyway: look at the replicas' outputs.
        parts = BalancedDataParallel(wrapped.module, ["cpu", "cpu", "cpu"], gather_output=False)(x)
    assert not out.requires_grad
    assert all(o.grad_fn is None for o in parts.outputs)
    torch.testing.assert_close(out, wrapped.module(x).detach())


def test_batchnorm_running_stats_are_updated_once_by_the_home_replica() -> None:
    torch.manual_seed(3)
    x = torch.randn(8, 3)
    single = nn.BatchNorm1d(3)
    single(x[:4])  # the home device's share
    wrapped = BalancedDataParallel(nn.BatchNorm1d(3), ["cpu", "cpu"])
    wrapped(x)
    torch.testing.assert_close(wrapped.module.running_mean, single.running_mean)


# ---------------------------------------------------------------- GPU (skipped here)


@requires_cuda
@pytest.mark.gpu
def test_cuda_virtual_devices_match_one_device() -> None:
    torch.manual_seed(4)
    net = MLP().cuda()
    reference = copy.deepcopy(net)
    x, y = torch.randn(9, 5, device="cuda"), torch.randn(9, 3, device="cuda")
    wrapped = BalancedDataParallel(net, ["cuda:0", "cuda:0"], weights=[2, 1])
    nn.functional.mse_loss(wrapped(x), y).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert _relative_error(p.grad, q.grad) <= 1e-5


def test_auto_weights_plan_on_the_first_batch_and_stay_exact() -> None:
    torch.manual_seed(5)
    net = MLP()
    reference = copy.deepcopy(net)
    x, y = torch.randn(7, 5), torch.randn(7, 3)
    wrapped = BalancedDataParallel(net, ["cpu"] * 3, weights="auto")
    assert wrapped.weights is None  # planned lazily, from the first real batch
    nn.functional.mse_loss(wrapped(x), y).backward()
    nn.functional.mse_loss(reference(x), y).backward()
    # Virtual CPU devices have no memory to read: the planner gives equal weights.
    assert wrapped.weights == [1.0, 1.0, 1.0]
    assert wrapped.last_sizes == [3, 2, 2]
    for p, q in zip(net.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert _relative_error(p.grad, q.grad) <= 1e-5


def test_unknown_weights_string_is_refused() -> None:
    with pytest.raises(EvendpError, match=r"'even' is not understood.*'auto'"):
        BalancedDataParallel(nn.Linear(1, 1), ["cpu"], weights="even")  # type: ignore[arg-type]


def test_an_empty_batch_gives_the_module_output_and_a_zero_summed_loss() -> None:
    wrapped = BalancedDataParallel(nn.Linear(3, 2), ["cpu"] * 3, gather_output=False)
    parts = wrapped(torch.randn(0, 3))
    assert parts.sizes == [0]
    loss = ParallelCriterion(nn.MSELoss(reduction="sum"), "sum")(parts, torch.randn(0, 2))
    assert loss.item() == 0.0
    assert gather(parts).shape == (0, 2)
