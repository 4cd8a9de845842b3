"""A small character-level GPT in the style of nanoGPT (the demo model of ``evendp train``):
readable, one file, shape comments."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .._core._errors import EvendpError
from .._core._validate import validate_int

__all__ = ["GPT", "GPTConfig"]


@dataclass
class GPTConfig:
    """Sizes of a :class:`GPT`; ``vocab_size`` is the number of distinct characters.

    >>> GPTConfig(vocab_size=96).n_embd
    128
    """

    vocab_size: int = 96
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            validate_int(f"GPTConfig.{name}", getattr(self, name), minimum=1)
        if self.n_embd % self.n_head:
            raise EvendpError(
                f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}; "
                "pick n_embd as a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise EvendpError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        # Lower-triangular mask, a buffer so it follows the module across devices.
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, config.block_size, config.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape  # batch, time, channels
        q, k, v = self.qkv(x).split(C, dim=2)  # each (B, T, C)
        # (B, T, C) -> (B, nh, T, hs): heads become a batch dimension.
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # Explicit attention (not the fused kernel) so the math, and its memory, is plain.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        mask: torch.Tensor = self.mask  # type: ignore[assignment]  # a registered buffer
        att = att.masked_fill(~mask[:, :, :T, :T], float("-inf"))
        att = self.attn_dropout(F.softmax(att, dim=-1))
        y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again
        return self.resid_dropout(self.proj(y))


class MLP(nn.Module):
    """The position-wise feed-forward block: widen 4x, GELU, project back."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """One transformer block, pre-norm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer over characters: ``forward(idx, targets=None)`` returns
    ``(B, T, vocab_size)`` logits and the mean cross-entropy (``None`` without targets).

    >>> torch.manual_seed(0) and None
    >>> model = GPT(GPTConfig(vocab_size=10, block_size=8, n_layer=1, n_head=2, n_embd=16))
    >>> idx = torch.randint(0, 10, (3, 8))
    >>> logits, loss = model(idx, idx)
    >>> logits.shape, loss.shape
    (torch.Size([3, 8, 10]), torch.Size([]))
    >>> abs(loss.item() - math.log(10)) < 0.5  # near uniform at initialization
    True
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (as in GPT-2): the output layer reuses the token embedding.
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2's initialization: small normal weights, zero biases.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        B, T = idx.shape  # batch, time (character positions)
        if self.config.block_size < T:
            raise EvendpError(
                f"sequence length {T} exceeds block_size={self.config.block_size}; "
                "crop the input or build the model with a larger block_size"
            )
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, vocab_size)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(B * T, -1), targets.view(B * T))
        return logits, loss

    def example_batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Random ``(idx, targets)`` of ``batch_size`` full-length sequences (for planning).

        >>> GPT(GPTConfig(n_layer=1)).example_batch(2)[0].shape
        torch.Size([2, 64])
        """
        shape = (batch_size, self.config.block_size)
        device = self.tok_emb.weight.device
        idx = torch.randint(0, self.config.vocab_size, shape, device=device)
        return idx, torch.randint(0, self.config.vocab_size, shape, device=device)
