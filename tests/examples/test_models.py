"""The example models: shapes, loss, weight tying, the LM head's logits size."""

from __future__ import annotations

import math

import pytest
import torch

from evendp._core._errors import EvendpError
from evendp.examples.gpt import GPT, GPTConfig
from evendp.examples.lm_head import LMHead, lm_loss


def test_gpt_forward_and_loss() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=20, block_size=16, n_layer=2, n_head=2, n_embd=32))
    idx = torch.randint(0, 20, (4, 16))
    targets = torch.randint(0, 20, (4, 16))
    logits, loss = model(idx, targets)
    assert logits.shape == (4, 16, 20)
    assert loss is not None and abs(loss.item() - math.log(20)) < 0.3
    assert model(idx[:, :5])[1] is None
    assert model.lm_head.weight is model.tok_emb.weight
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_gpt_rejects_long_input_and_bad_config() -> None:
    model = GPT(GPTConfig(block_size=8, n_layer=1))
    with pytest.raises(EvendpError, match="block_size"):
        model(torch.zeros(1, 9, dtype=torch.long))
    with pytest.raises(EvendpError, match="divisible"):
        GPTConfig(n_embd=130, n_head=4)


def test_lm_head_logits_size() -> None:
    model = LMHead(vocab_size=300, seq_len=25, n_embd=8)
    x, y = model.example_batch(4)
    logits = model(x)
    assert logits.shape == (4, 25, 300)
    assert logits.numel() * logits.element_size() == 4 * 25 * 300 * 4
    assert lm_loss(logits, y).dim() == 0
