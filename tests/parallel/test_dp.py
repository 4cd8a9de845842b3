"""BalancedDataParallel on virtual CPU devices: exactness, inputs, outputs, state dicts, errors."""

from __future__ import annotations

import copy
import functools
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

CPU = torch.device("cpu")

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
    assert wrapped.weights is None  # planned when asked, on the first real batch
    wrapped.plan_weights(x)
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


def test_the_old_positional_signature_gets_the_new_call_in_its_error() -> None:
    with pytest.raises(EvendpError, match=r"BalancedDataParallel\(model, device_ids, weights=\["):
        BalancedDataParallel(4, nn.Linear(2, 1), dim=0)  # type: ignore[arg-type]
    with pytest.raises(EvendpError, match=r"first argument must be the nn\.Module"):
        BalancedDataParallel("model")  # type: ignore[arg-type]


# ---------------------------------------------------------------- fixed_sizes


def test_fixed_sizes_run_exactly_those_shares_and_restore_the_weights() -> None:
    torch.manual_seed(6)
    net = nn.Linear(3, 1)
    wrapped = BalancedDataParallel(net, ["cpu"] * 3, weights=[1, 1, 1])
    x = torch.randn(6, 3)
    with wrapped.fixed_sizes([0, 5, 1]):
        out = wrapped(x)
        assert wrapped.last_sizes == [0, 5, 1]
        with wrapped.fixed_sizes([6, 0, 0]):
            wrapped(x)
            assert wrapped.last_sizes == [6, 0, 0]
        wrapped(x)
        assert wrapped.last_sizes == [0, 5, 1]  # the outer sizes again
    torch.testing.assert_close(out, net(x))
    wrapped(x)
    assert wrapped.last_sizes == [2, 2, 2]


@pytest.mark.parametrize(
    ("sizes", "fragment"),
    [
        ([2, 2], r"fixed_sizes\(\[2, 2\]\) has 2 sizes for 3 devices"),
        ([3, -1, 2], "size -1 at position 1 is not a non-negative int"),
        ([3, 1.5, 2], "size 1.5 at position 1"),
        ("3,1,2", "one non-negative int per device"),
    ],
)
def test_fixed_sizes_refuse_bad_sizes_on_entry(sizes: object, fragment: str) -> None:
    wrapped = BalancedDataParallel(nn.Linear(3, 1), ["cpu"] * 3)
    with pytest.raises(EvendpError, match=fragment), wrapped.fixed_sizes(sizes):  # type: ignore[arg-type]
        pass


def test_fixed_sizes_that_do_not_add_up_to_the_batch_name_both() -> None:
    wrapped = BalancedDataParallel(nn.Linear(3, 1), ["cpu"] * 3)
    with (
        wrapped.fixed_sizes([2, 2, 1]),
        pytest.raises(
            EvendpError, match=r"fixed_sizes\(\[2, 2, 1\]\) add up to 5, but the batch has 6"
        ),
    ):
        wrapped(torch.randn(6, 3))
    assert wrapped._sizes is None  # left even after the failed call


# ---------------------------------------------------------------- count_fn


class MaskedTokenLoss(nn.Module):
    """A token model whose forward returns the mean cross-entropy over unmasked tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(7, 6)
        self.head = nn.Linear(6, 7)

    def forward(self, idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.head(torch.tanh(self.embed(idx)))  # (B, T, 7)
        per_token = nn.functional.cross_entropy(logits.transpose(1, 2), idx, reduction="none")
        return (per_token * mask).sum() / mask.sum()


def _token_count(idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return mask.sum()


def test_count_fn_makes_a_masked_mean_exact_and_an_all_masked_share_harmless() -> None:
    torch.manual_seed(7)
    model = MaskedTokenLoss()
    reference = copy.deepcopy(model)
    idx = torch.randint(0, 7, (5, 4))
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    wrapped = BalancedDataParallel(model, ["cpu"] * 3, count_fn=_token_count)
    with wrapped.fixed_sizes([2, 1, 2]):  # the last share has no unmasked token
        loss = wrapped(idx, mask.float())
    loss.backward()
    ref_loss = reference(idx, mask.float())
    ref_loss.backward()
    assert _relative_error(loss.detach(), ref_loss.detach()) <= 1e-5
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.isfinite(p.grad).all()
        assert _relative_error(p.grad, q.grad) <= 1e-5


def test_without_count_fn_the_same_masked_loss_is_biased() -> None:
    torch.manual_seed(7)
    model = MaskedTokenLoss()
    idx = torch.randint(0, 7, (4, 4))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1], [1, 0, 0, 0]]).float()
    wrapped = BalancedDataParallel(model, ["cpu"] * 2, weights=[3, 1])
    assert abs(wrapped(idx, mask).item() - model(idx, mask).item()) > 1e-3


@pytest.mark.parametrize(
    ("returned", "fragment"),
    [
        (-1, "returned -1 for the share of 2 sample"),
        (float("nan"), "returned nan"),
        ("3", "returned '3'"),
        (True, "returned True"),
        (torch.ones(2), r"returned 'a tensor of shape \[2\]'"),
    ],
)
def test_a_bad_count_names_the_device_and_the_share(returned: object, fragment: str) -> None:
    wrapped = BalancedDataParallel(
        nn.Linear(2, 1), ["cpu"] * 2, weights=[1, 1], count_fn=lambda x: returned
    )
    with pytest.raises(EvendpError, match=fragment) as info:
        wrapped(torch.randn(4, 2))
    assert "device_ids[0]=cpu" in str(info.value)


def test_count_fn_must_be_callable() -> None:
    with pytest.raises(EvendpError, match="count_fn must be callable"):
        BalancedDataParallel(nn.Linear(2, 1), ["cpu"], count_fn=3)  # type: ignore[arg-type]


# ---------------------------------------------------------------- ParallelCriterion callables


def _lm_scattered(
    weights: list[float], seed: int = 8
) -> tuple[nn.Module, Scattered, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    head = nn.Linear(4, 5)
    hidden = torch.randn(6, 3, 4)  # (N, L, hidden) -> logits (N, L, V=5)
    labels = torch.randint(0, 5, (6, 3))
    labels[1:3] = -100  # rows 1 and 2 are all padding
    labels[4, 1:] = -100
    wrapped = BalancedDataParallel(
        head, ["cpu"] * len(weights), weights=weights, gather_output=False
    )
    return head, wrapped(hidden), hidden, labels


def _flat_ce(logits: torch.Tensor, labels: torch.Tensor, **kwargs: object) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "criterion",
    [
        _flat_ce,
        lambda logits, labels: _flat_ce(logits, labels),
        functools.partial(_flat_ce, ignore_index=-100),
    ],
    ids=["function", "lambda", "partial"],
)
def test_any_callable_criterion_with_count_fn_is_exact_on_lm_logits(
    criterion: Callable[..., torch.Tensor],
) -> None:
    head, parts, hidden, labels = _lm_scattered([1, 2, 1])
    loss = ParallelCriterion(criterion, count_fn=lambda out, y: (y != -100).sum())(parts, labels)
    expected = _flat_ce(head(hidden), labels)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    grad = head.weight.grad
    head.zero_grad()
    expected.backward()
    assert grad is not None and head.weight.grad is not None
    assert _relative_error(grad, head.weight.grad) <= 1e-5


class FlatCE(nn.Module):
    """A stateless criterion module: no parameters, no buffers."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return _flat_ce(logits, labels)


def test_modules_are_replicated_only_when_they_hold_tensors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import evendp._parallel._criterion as dp

    _, parts, _, labels = _lm_scattered([1, 1])
    copied: list[nn.Module] = []
    real = dp.replicate

    def spy(module: nn.Module, *args: object) -> list[nn.Module]:
        copied.append(module)
        return real(module, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(dp, "replicate", spy)
    ParallelCriterion(FlatCE())(parts, labels)
    weighted = nn.CrossEntropyLoss(weight=torch.rand(5) + 0.5)
    ParallelCriterion(lambda out, y: weighted(out.flatten(0, 1), y.flatten()))(parts, labels)
    assert copied == []  # a stateless module and a lambda are called as they are
    flat = Scattered([o.flatten(0, 1) for o in parts.outputs], [9, 9], parts.devices, 0, CPU)
    ParallelCriterion(weighted)(flat, labels.flatten())
    assert copied == [weighted]  # a module with a buffer gets a copy per device


@pytest.mark.parametrize(
    "criterion",
    [
        nn.CrossEntropyLoss(),
        nn.CrossEntropyLoss(ignore_index=-100, weight=torch.tensor([0.5, 1, 2, 1, 3])),
        nn.CrossEntropyLoss(label_smoothing=0.1, weight=torch.tensor([0.5, 1, 2, 1, 3])),
    ],
    ids=["ignore_index", "weight", "label_smoothing"],
)
def test_built_in_class_losses_count_their_own_denominator(criterion: nn.Module) -> None:
    torch.manual_seed(9)
    net = nn.Linear(4, 5)
    x = torch.randn(9, 4)
    y = torch.tensor([0, -100, 2, 3, -100, -100, 1, 4, 2])
    parts = BalancedDataParallel(net, ["cpu"] * 3, weights=[3, 1, 2], gather_output=False)(x)
    torch.testing.assert_close(ParallelCriterion(criterion)(parts, y), criterion(net(x), y))


def test_count_fn_with_a_summing_reduction_is_refused() -> None:
    with pytest.raises(EvendpError, match="reduction='sum' adds per-device sums"):
        ParallelCriterion(_flat_ce, reduction="sum", count_fn=lambda out, y: 1)
    with pytest.raises(EvendpError, match="criterion must be callable"):
        ParallelCriterion("cross_entropy")  # type: ignore[arg-type]


# ---------------------------------------------------------------- BatchNorm


def _bn_net() -> nn.Module:
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 1))


def test_batchnorm_in_training_with_an_uneven_split_warns_once_with_the_fix() -> None:
    with pytest.warns(
        UserWarning, match=r"BatchNorm layer '1'.*GroupNorm or LayerNorm.*SyncBatchNorm"
    ):
        BalancedDataParallel(_bn_net(), ["cpu"] * 3, weights=[2, 1, 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BalancedDataParallel(_bn_net(), ["cpu"] * 3)  # even: as nn.DataParallel
        BalancedDataParallel(_bn_net(), ["cpu"] * 3, weights=[1, 0, 1])  # even over the active
        BalancedDataParallel(_bn_net().eval(), ["cpu"] * 3, weights=[2, 1, 1])
        BalancedDataParallel(_bn_net(), ["cpu"], weights=[1])
        BalancedDataParallel(MLP(), ["cpu"] * 3, weights=[2, 1, 1])


def test_batchnorm_warns_on_every_uneven_split_whoever_chose_it() -> None:
    """Issue 36: the planner's uneven splits assigned after wrapping (a rehearsal's, and
    ``weights="auto"``'s once planned, on GPUs) gave no warning; weights given to the
    constructor did."""
    wrapped = BalancedDataParallel(_bn_net(), ["cpu"] * 2)  # even: no warning
    with pytest.warns(UserWarning, match=r"BatchNorm layer '1'.*weights=\[3.0, 1.0\]"):
        wrapped.weights = [3, 1]  # as rehearse() assigns the planner's split
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapped.weights = [2, 2]  # even again: nothing to say


def test_a_one_sample_share_that_batchnorm_rejects_names_the_device_and_share() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        wrapped = BalancedDataParallel(_bn_net(), ["cpu"] * 3, weights=[4, 4, 1])
    with pytest.raises(EvendpError, match=r"device_ids\[2\]=cpu got a share of 1 sample"):
        wrapped(torch.randn(9, 3))
    with pytest.raises(ValueError, match="Expected more than 1 value"):
        BalancedDataParallel(_bn_net(), ["cpu"])(torch.randn(1, 3))  # torch's own: no split


def test_scattered_keeps_the_counts_and_gather_combines_by_them() -> None:
    torch.manual_seed(10)
    model = MaskedTokenLoss()
    idx = torch.randint(0, 7, (4, 3))
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0], [0, 0, 0]]).float()
    wrapped = BalancedDataParallel(
        model, ["cpu"] * 2, weights=[1, 1], gather_output=False, count_fn=_token_count
    )
    parts = wrapped(idx, mask)
    assert parts.counts == [6.0, 1.0]
    torch.testing.assert_close(gather(parts), model(idx, mask))


def test_a_criterion_over_ignored_labels_warns_once_unless_it_is_counted() -> None:
    import evendp

    _, parts, _, labels = _lm_scattered([2, 1])
    criterion = ParallelCriterion(_flat_ce)
    with pytest.warns(UserWarning, match=r"ParallelCriterion \(function\).*count_tokens"):
        criterion(parts, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        criterion(parts, labels)  # once
        counted = ParallelCriterion(_flat_ce, count_fn=evendp.count_tokens(shift=False))
        exact = counted(parts, labels)
        ParallelCriterion(FlatCE())  # built only
    want = _flat_ce(torch.cat([o for o in parts.outputs]), labels)
    torch.testing.assert_close(exact, want, rtol=1e-5, atol=1e-7)


class _Echo(nn.Module):
    """Returns its rows' names and a mean: strings go in and come back per row."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(1, 1)

    def forward(self, x: torch.Tensor, names: list[str]) -> tuple[list[str], torch.Tensor]:
        assert names == [f"n{int(v)}" for v in x[:, 0]]
        return [n.upper() for n in names], self.lin(x).mean()


def test_per_row_strings_go_to_their_replica_and_come_back_in_row_order() -> None:
    model = _Echo()
    x = torch.arange(6.0)[:, None]
    names, loss = BalancedDataParallel(model, ["cpu"] * 3, weights=[3, 0, 2])(
        x, [f"n{i}" for i in range(6)]
    )
    assert names == [f"N{i}" for i in range(6)]
    torch.testing.assert_close(loss, model.lin(x).mean())


# ---------------------------------------------------------------- weights="auto", planned ahead

#: Declared memory for three virtual devices: the planner splits a tiny GPT-2 unevenly in it.
AUTO_MEMORY = "8MiB,4MiB,2MiB"


def _tiny_gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,  # no dropout: one device's masks
    )  # fmt: skip
    return GPT2LMHeadModel(config)


def _lm_batch(rows: int = 6) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (rows, 16), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[0, 5:] = -100  # padding: shares count different numbers of tokens
    return {"input_ids": ids, "labels": labels}


class _PlannerCalls:
    """Counts the planner's calls (what ``weights="auto"`` plans through) and passes them on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import evendp._planning._planner as plan_pkg

        self.calls = 0
        real = plan_pkg.auto_weights

        def counted(*args: object, **kwargs: object) -> list[float]:
            self.calls += 1
            return real(*args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(plan_pkg, "auto_weights", counted)


@pytest.mark.parametrize("memory", [None, AUTO_MEMORY], ids=["undeclared", "declared"])
def test_auto_planned_at_construction_or_by_plan_weights_alike(
    memory: str | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 33: "auto" plans before the first forward (example=, or plan_weights), the same
    weights either way, said as the Trainer says its split; forwards after it do not plan
    again."""
    if memory is None:
        monkeypatch.delenv("EVENDP_MEMORY", raising=False)
    else:
        monkeypatch.setenv("EVENDP_MEMORY", memory)
    planner = _PlannerCalls(monkeypatch)
    model, batch = _tiny_gpt2(), _lm_batch()
    built = BalancedDataParallel(model, ["cpu"] * 3, weights="auto", example=batch)
    stepwise = BalancedDataParallel(copy.deepcopy(model), ["cpu"] * 3, weights="auto")
    chosen = stepwise.plan_weights(**batch)
    assert built.weights == chosen == stepwise.weights
    if memory is None:
        assert built.weights == [1.0, 1.0, 1.0]  # CPU devices: no memory to read, even
    else:
        assert built.split(6) == [3, 2, 1]  # the declared memory, planned
    assert planner.calls == 2
    for wrapped in (built, stepwise, built):
        wrapped(**batch)
    assert planner.calls == 2  # no planning in forward
    said = capsys.readouterr().err
    line = f"evendp: weights='auto' planned {built.split(6)} per device for a global batch of 6"
    assert said.count(line) == 2, said
    if memory is not None:
        assert f"(declared memory {memory})" in said


def test_a_forward_while_unplanned_is_refused_with_the_fix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 52: "auto" plans only when asked; a forward that would have to plan is refused
    in one message naming both ways to ask, and plans nothing."""
    monkeypatch.delenv("EVENDP_MEMORY", raising=False)
    planner = _PlannerCalls(monkeypatch)
    wrapped = BalancedDataParallel(MLP(), ["cpu"] * 3, weights="auto")
    x = torch.randn(7, 5)
    with pytest.raises(EvendpError, match=r"no weights yet.*example=\(x,\).*plan_weights\(x\)"):
        wrapped(x)
    assert wrapped.weights is None and wrapped.last_sizes == [] and planner.calls == 0
    with wrapped.fixed_sizes([3, 2, 2]):  # sizes given: nothing to plan
        wrapped(x)
    assert planner.calls == 0
    assert wrapped.plan_weights(x) == [1.0, 1.0, 1.0] and planner.calls == 1
    wrapped(x)
    assert wrapped.last_sizes == [3, 2, 2] and planner.calls == 1
    wrapped.weights = "auto"  # plan again: at the next explicit step
    with pytest.raises(EvendpError, match="no weights yet"):
        wrapped(x)
    assert wrapped.plan_weights(x) == [1.0, 1.0, 1.0] and planner.calls == 2


def test_construction_time_auto_keeps_the_gradient_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENDP_MEMORY", AUTO_MEMORY)
    model, batch = _tiny_gpt2(), _lm_batch()
    reference = copy.deepcopy(model)
    wrapped = BalancedDataParallel(model, ["cpu"] * 3, weights="auto", example=batch)
    loss = wrapped(**batch).loss
    assert wrapped.last_sizes == [3, 2, 1]  # uneven, and the shares count unequal tokens
    want = reference(**batch).loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)
    loss.backward()
    want.backward()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert _relative_error(p.grad, q.grad) <= 1e-5


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"example": (torch.randn(2, 5),)}, r"weights are not 'auto'.*drop example="),
        ({"weights": "auto", "example": 3}, r"got an int; pass a tuple.*example=\(x,\)"),
    ],
)
def test_a_bad_example_names_the_fix(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(EvendpError, match=fragment):
        BalancedDataParallel(MLP(), ["cpu"] * 2, **kwargs)  # type: ignore[arg-type]


def test_plan_weights_takes_one_batch_as_forward_does() -> None:
    wrapped = BalancedDataParallel(MLP(), ["cpu"] * 2, weights="auto")
    with pytest.raises(EvendpError, match="all positionally or all as keywords"):
        wrapped.plan_weights(torch.randn(3, 5), y=torch.randn(3))
    with pytest.raises(EvendpError, match="no tensor with a batch dimension"):
        wrapped.plan_weights(3)
    assert wrapped.weights is None  # nothing planned


def test_plan_weights_plans_forward_only_under_no_grad(monkeypatch: pytest.MonkeyPatch) -> None:
    import evendp._planning._planner as plan_pkg

    seen: list[bool] = []

    def record(*args: object, no_grad: bool = False, **kwargs: object) -> list[float]:
        seen.append(no_grad)
        return [1.0, 1.0]

    monkeypatch.setattr(plan_pkg, "auto_weights", record)
    x = torch.randn(5, 5)
    with torch.no_grad():
        BalancedDataParallel(MLP(), ["cpu"] * 2, weights="auto").plan_weights(x)
        BalancedDataParallel(MLP(), ["cpu"] * 2, weights="auto", example=(x,))
    BalancedDataParallel(MLP(), ["cpu"] * 2, weights="auto").plan_weights(x)
    assert seen == [True, True, False]
