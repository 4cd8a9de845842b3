"""What proves a checkpoint whole: a digest of its contents, and a finite check of its tensors.

The digest is a SHA-256 over the payload's *contents* (every tensor's dtype, shape and bytes,
every other value's ``repr``, in a fixed order), not over the file's bytes: it is computed from
the state before writing and recomputed from the state read back, so a file whose tensor data
was garbled (a flipped bit, a torn copy) is caught even where ``torch.load`` reads it without
complaint. The file stays a plain ``torch.save`` dict.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

__all__ = ["content_digest", "digest_words", "first_non_finite"]

_SKIP = "sha256"  # the key that holds the digest is not part of what it covers


def content_digest(payload: Mapping[str, Any]) -> str:
    """The hex SHA-256 of ``payload``'s contents (the ``sha256`` key excluded).

    >>> a = {"step": 1, "model": {"w": torch.ones(2)}}
    >>> content_digest(a) == content_digest({"model": {"w": torch.ones(2)}, "step": 1})
    True
    >>> content_digest(a) == content_digest({"step": 1, "model": {"w": torch.zeros(2)}})
    False
    """
    h = hashlib.sha256()
    for chunk in _chunks({k: v for k, v in payload.items() if k != _SKIP}):
        h.update(chunk)
    return h.hexdigest()


def digest_words(data: bytes, words: int = 4) -> list[int]:
    """The first ``words`` 8-byte words of ``data``'s SHA-256 as signed int64, to travel in an
    int64 tensor of a collective.

    >>> len(digest_words(b"x")), digest_words(b"x", 2) == digest_words(b"x")[:2]
    (4, True)
    """
    raw = hashlib.sha256(data).digest()
    return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, 8 * words, 8)]


def _chunks(value: Any) -> Iterator[bytes]:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        yield f"T{t.dtype}{tuple(t.shape)}".encode()
        if t.numel():
            yield t.reshape(-1).view(torch.uint8).numpy().tobytes()
    elif isinstance(value, Mapping):
        yield b"{"
        for key in sorted(value, key=repr):
            yield repr(key).encode() + b":"
            yield from _chunks(value[key])
        yield b"}"
    elif isinstance(value, list | tuple):
        yield b"[" if isinstance(value, list) else b"("
        for item in value:
            yield from _chunks(item)
        yield b"]"
    else:
        yield repr(value).encode() + b";"


def first_non_finite(state: Any, prefix: str = "") -> str | None:
    """The name of the first floating-point tensor (or float) holding NaN or inf, else None.

    >>> first_non_finite({"model": {"w": torch.ones(2), "b": torch.tensor([float("nan")])}})
    'model.b'
    >>> first_non_finite({"model": {"w": torch.ones(2)}}) is None
    True
    """
    if isinstance(state, torch.Tensor):
        local = state.to_local() if hasattr(state, "to_local") else state  # a DTensor shard
        if local.is_floating_point() and local.numel() and not bool(torch.isfinite(local).all()):
            return prefix or "tensor"
        return None
    if isinstance(state, float):
        return None if math.isfinite(state) else prefix or "value"
    if isinstance(state, Mapping):
        items: Any = state.items()
    elif isinstance(state, list | tuple):
        items = enumerate(state)
    else:
        return None
    for key, value in items:
        found = first_non_finite(value, f"{prefix}.{key}" if prefix else str(key))
        if found is not None:
            return found
    return None
