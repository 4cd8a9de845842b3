"""``evendp.predict`` in one process: a tiny BERT's features over 53 padded samples on three
uneven virtual devices equal one device's, in dataset order (the gloo ranks' version runs in
tests/training/test_eval_gloo.py, sharing one spawn with the evaluation checks)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from evendp import EvendpError, predict


def tiny_bert() -> nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    return BertModel(config, add_pooling_layer=False)


def padded_samples(n: int = 53, length: int = 12, seed: int = 0) -> list[dict[str, Any]]:
    """Token windows of random lengths, right-padded with 0 and masked out."""
    g = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(n):
        used = int(torch.randint(2, length + 1, (), generator=g))
        ids = torch.zeros(length, dtype=torch.long)
        ids[:used] = torch.randint(1, 64, (used,), generator=g)
        samples.append({"input_ids": ids, "attention_mask": (ids > 0).long()})
    return samples


def one_device_features(model: nn.Module, samples: list[dict[str, Any]]) -> torch.Tensor:
    batch = torch.utils.data.default_collate(samples)
    model.eval()
    with torch.no_grad():
        return model(**batch).last_hidden_state


@pytest.mark.parametrize(
    ("weights", "batch_size"), [([2, 1, 1], 8), ([0, 3, 1], 10), ([1, 1, 1], 53)]
)
def test_features_over_uneven_devices_equal_one_devices_in_order(
    weights: list[int], batch_size: int
) -> None:
    model = tiny_bert().train()  # predict runs in eval mode and gives the flag back
    samples = padded_samples()
    expected = one_device_features(model, samples)
    model.train()
    pred = predict(model, samples, device_ids=["cpu"] * 3, weights=weights, batch_size=batch_size)
    assert model.training and all(m.training for m in model.modules())
    assert pred.indices.tolist() == list(range(53))
    got = pred.outputs.last_hidden_state
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not got.is_inference()  # joined outside inference mode: usable in autograd


def test_a_shuffled_order_would_be_caught() -> None:
    # The check above can fail: outputs of the same samples in another order differ.
    model = tiny_bert()
    samples = padded_samples()
    expected = one_device_features(model, samples)
    shuffled = [samples[i] for i in torch.randperm(53, generator=torch.Generator().manual_seed(1))]
    pred = predict(model, shuffled, device_ids=["cpu"] * 3, weights=[2, 1, 1], batch_size=8)
    assert not torch.allclose(pred.outputs.last_hidden_state, expected, atol=1e-3)


def test_no_grad_mode_and_auto_weights_on_virtual_devices() -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    x = torch.randn(11, 4)
    with torch.no_grad():
        expected = net.eval()(x)
    pred = predict(net.train(), x, device_ids=["cpu"] * 2, weights="auto", batch_size=4,
                   inference_mode=False)  # fmt: skip
    torch.testing.assert_close(pred.outputs, expected)


def test_bad_input_names_the_value() -> None:
    net = nn.Linear(4, 2)
    with pytest.raises(EvendpError, match="map-style dataset"):
        predict(net, (torch.randn(4) for _ in range(3)), device_ids=["cpu"])
    with pytest.raises(EvendpError, match="batch_size"):
        predict(net, torch.randn(5, 4), device_ids=["cpu"], batch_size=0)
    with pytest.raises(EvendpError, match="scalar"):
        predict(lambda_module(), torch.randn(5, 4), device_ids=["cpu"] * 2, batch_size=4)


def lambda_module() -> nn.Module:
    class MeanLoss(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.pow(2).mean()

    return MeanLoss()


def test_auto_weights_are_planned_before_the_first_forward() -> None:
    """Issue 33: predict plans "auto" on its first batch itself (forward-only), as
    BalancedDataParallel's forward, which refuses to plan, needs."""
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(11, 4)
    pred = predict(net, x, device_ids=["cpu"] * 2, weights="auto", batch_size=4)
    torch.testing.assert_close(pred.outputs, net(x))
