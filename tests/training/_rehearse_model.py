"""A user's own model for the rehearsal tests: a tiny GPT-2 from a config, token windows.

``make()`` is what ``evendp train --model tests.training._rehearse_model:make`` calls: it
returns ``(model, dataset, loss_fn)``.
"""

from __future__ import annotations

from typing import Any

import torch

SEQ, VOCAB, ROWS = 64, 128, 192


def loss_fn(model: Any, batch: Any) -> torch.Tensor:
    """The causal LM loss: every row has SEQ - 1 labels, so rows weigh alike."""
    (ids,) = batch
    return model(input_ids=ids, labels=ids).loss


def make() -> tuple[Any, Any, Any]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    config._attn_implementation = "eager"  # attention probabilities kept: a memory-bound model
    model = GPT2LMHeadModel(config)
    data = torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (ROWS, SEQ)))
    return model, data, loss_fn
