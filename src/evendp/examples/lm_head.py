"""A language-model head: an embedding, then one linear layer to a large vocabulary; its
logits (40,000 x 250 x 32 fp32: 1.28e9 bytes) are what ``nn.DataParallel`` gathers on one
device, the first to run out of memory."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._core._validate import validate_int

__all__ = ["LMHead", "lm_loss"]


class LMHead(nn.Module):
    """``(B, T)`` token ids -> ``(B, T, vocab)`` logits through an embedding and a linear layer.

    >>> model = LMHead(vocab_size=50, seq_len=7, n_embd=16)
    >>> x, y = model.example_batch(3)
    >>> logits = model(x)
    >>> logits.shape, lm_loss(logits, y).shape
    (torch.Size([3, 7, 50]), torch.Size([]))
    """

    def __init__(self, vocab_size: int = 40_000, seq_len: int = 250, n_embd: int = 512) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("seq_len", seq_len), ("n_embd", n_embd)):
            validate_int(f"LMHead {name}", value, minimum=1)
        self.vocab_size = vocab_size
        self.seq_len = seq_len
        self.embed = nn.Embedding(vocab_size, n_embd)
        self.head = nn.Linear(n_embd, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(idx))  # (B, T) -> (B, T, C) -> (B, T, vocab)

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random ``(tokens, next tokens)`` of shape ``(batch_size, seq_len)`` each."""
        shape = (batch_size, self.seq_len)
        device = self.head.weight.device
        idx = torch.randint(0, self.vocab_size, shape, device=device)
        return idx, torch.randint(0, self.vocab_size, shape, device=device)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position: ``(B, T, V)`` logits, ``(B, T)`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
