"""The built-in corpus: the Python standard library's own ``.py`` source (on every machine:
nothing to download), read in a fixed order up to a character cap, printable ASCII only."""

from __future__ import annotations

import re
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset

from .._core._errors import EvendpError
from .._core._validate import validate_int

__all__ = [
    "IGNORE_INDEX",
    "CharVocab",
    "CharWindows",
    "CodeParagraphs",
    "load_corpus",
    "stdlib_dataset",
    "stdlib_paragraphs",
]

#: The label of a padding position: ``F.cross_entropy`` (and the GPT's loss) skip it.
IGNORE_INDEX = -100

# Printable ASCII plus newline; tabs become four spaces (PEP 8 code has almost none).
_ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))


def load_corpus(max_chars: int = 1_000_000, stdlib_dir: str | Path | None = None) -> str:
    """Return up to ``max_chars`` characters of standard-library source, in a fixed order.

    >>> text = load_corpus(max_chars=2000)
    >>> len(text)
    2000
    >>> text == load_corpus(max_chars=2000)  # same machine, same text
    True
    """
    validate_int("max_chars", max_chars, minimum=1, example="max_chars=64")
    root = Path(stdlib_dir if stdlib_dir is not None else sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise EvendpError(
            f"no .py files in {str(root)!r}; pass stdlib_dir= a folder of Python sources"
        )
    allowed = set(_ALPHABET)
    parts: list[str] = []
    total = 0
    for path in files:
        try:
            raw = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue  # an unreadable file is skipped; the order of the rest stays fixed
        text = "".join(ch for ch in raw.replace("\t", "    ") if ch in allowed)
        parts.append(text)
        total += len(text)
        if total >= max_chars:
            break
    return "".join(parts)[:max_chars]


class CharVocab:
    """The corpus's characters (printable ASCII and newline): ``encode`` text to a ``LongTensor``
    of ids, ``decode`` back.

    >>> vocab = CharVocab()
    >>> vocab.decode(vocab.encode("def f(x):\\n    return x"))
    'def f(x):\\n    return x'
    >>> vocab.size
    96
    """

    def __init__(self) -> None:
        self.chars = list(_ALPHABET)
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        # A byte -> id table makes encoding a 1 MB corpus a single C-level translate.
        self._table = bytes(self.stoi.get(chr(b), 0) for b in range(256))

    @property
    def size(self) -> int:
        """Number of distinct characters (the model's vocabulary size)."""
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Ids of ``text`` as a 1-D ``int64`` tensor; unknown characters raise EvendpError."""
        unknown = set(text) - self.stoi.keys()
        if unknown:
            raise EvendpError(
                f"characters {sorted(unknown)[:5]!r} are not in the vocabulary (printable "
                "ASCII and newline); clean the text"
            )
        data = text.encode("ascii").translate(self._table)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()

    def decode(self, ids: torch.Tensor | Sequence[int]) -> str:
        """Text of a sequence of ids."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.chars[i] for i in values)


class CharWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Next-character windows: item ``i`` is ``(data[i:i+T], data[i+1:i+T+1])``, T = block_size.

    >>> ds = CharWindows(torch.arange(10), block_size=4)
    >>> len(ds)
    6
    >>> ds[2]
    (tensor([2, 3, 4, 5]), tensor([3, 4, 5, 6]))
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        validate_int("block_size", block_size, minimum=1, example="block_size=64")
        if data.dim() != 1 or len(data) <= block_size:
            raise EvendpError(
                f"data must be 1-D and longer than block_size={block_size}, got shape "
                f"{tuple(data.shape)}; load more text or use a smaller block_size"
            )
        self.data = data
        self.block_size = block_size

    def __len__(self) -> int:
        return len(self.data) - self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.data[i : i + self.block_size]  # (T,)
        y = self.data[i + 1 : i + 1 + self.block_size]  # (T,) shifted by one
        return x, y

    def batch(self, indices: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack the windows at ``indices`` into ``(x, y)`` of shape (B, T) without a loader.

        >>> x, y = CharWindows(torch.arange(10), block_size=3).batch([0, 5])
        >>> x.tolist(), y.tolist()
        ([[0, 1, 2], [5, 6, 7]], [[1, 2, 3], [6, 7, 8]])
        """
        idx = torch.as_tensor(indices, dtype=torch.long).view(-1, 1)  # (B, 1)
        windows = idx + torch.arange(self.block_size).view(1, -1)  # (B, T)
        return self.data[windows], self.data[windows + 1]


def _vocab_and_corpus(max_chars: int, val_fraction: float) -> tuple[CharVocab, str]:
    if not 0.0 <= val_fraction < 1.0:
        raise EvendpError(f"val_fraction must be in [0, 1), got {val_fraction!r}; e.g. 0.1")
    return CharVocab(), load_corpus(max_chars)


def stdlib_dataset(
    block_size: int = 64, max_chars: int = 1_000_000, val_fraction: float = 0.1
) -> tuple[CharWindows, CharWindows, CharVocab]:
    """Train and validation windows (the last ``val_fraction`` of the text) and the vocabulary.

    >>> train, val, vocab = stdlib_dataset(block_size=16, max_chars=5000)
    >>> len(train.data) + len(val.data), vocab.size
    (5000, 96)
    """
    vocab, text = _vocab_and_corpus(max_chars, val_fraction)
    data = vocab.encode(text)
    cut = len(data) - max(int(len(data) * val_fraction), block_size + 1)
    if cut <= block_size:
        raise EvendpError(
            f"max_chars={max_chars} is too small for block_size={block_size}; raise max_chars"
        )
    return CharWindows(data[:cut], block_size), CharWindows(data[cut:], block_size), vocab


class CodeParagraphs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Variable-length samples: one paragraph of code each, next-character pairs of its own
    length (at most ``block_size``); ``batch`` pads to the longest (``y`` with
    :data:`IGNORE_INDEX`); ``lengths[i]``: sample ``i``'s real targets, its cost.

    >>> ds = CodeParagraphs([torch.arange(5), torch.arange(3)], block_size=8)
    >>> ds.lengths
    [4, 2]
    >>> x, y = ds.batch([1, 0])
    >>> x.tolist(), y.tolist()
    ([[0, 1, 0, 0], [0, 1, 2, 3]], [[1, 2, -100, -100], [1, 2, 3, 4]])
    >>> int(CodeParagraphs.count_tokens((x, y)))  # what Trainer(count_fn=...) counts
    6
    """

    def __init__(
        self, paragraphs: Sequence[torch.Tensor], block_size: int, pad_id: int = 0
    ) -> None:
        validate_int("block_size", block_size, minimum=1, example="block_size=64")
        kept = [p[: block_size + 1] for p in paragraphs if p.dim() == 1 and len(p) >= 2]
        if not kept:
            raise EvendpError(
                "no paragraph has 2 or more characters; pass 1-D tensors of character ids"
            )
        self.paragraphs = kept
        self.block_size = block_size
        self.pad_id = pad_id
        self.lengths = [len(p) - 1 for p in kept]

    def __len__(self) -> int:
        return len(self.paragraphs)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.paragraphs[i]
        return p[:-1], p[1:]  # (L-1,) each

    def batch(self, indices: torch.Tensor | Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Pad the samples at ``indices`` to the longest: ``(x, y)`` of shape (B, T_max)."""
        return self.collate([self[int(i)] for i in indices])

    def collate(
        self, samples: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A ``collate_fn``: pad ``(x, y)`` pairs to the longest (x: ``pad_id``, y: -100)."""
        width = max((len(x) for x, _ in samples), default=1)
        x = torch.full((len(samples), width), self.pad_id, dtype=torch.long)  # (B, T)
        y = torch.full((len(samples), width), IGNORE_INDEX, dtype=torch.long)  # (B, T)
        for row, (xi, yi) in enumerate(samples):
            x[row, : len(xi)] = xi
            y[row, : len(yi)] = yi
        return x, y

    @staticmethod
    def count_tokens(batch: Sequence[torch.Tensor]) -> torch.Tensor:
        """The real (non-ignored) targets in ``(x, y)``: the count of a token-mean loss."""
        return (batch[1] != IGNORE_INDEX).sum()


def stdlib_paragraphs(
    block_size: int = 128, max_chars: int = 1_000_000, val_fraction: float = 0.1
) -> tuple[CodeParagraphs, CodeParagraphs, CharVocab]:
    """Train and validation paragraphs (split at blank lines, under 16 characters dropped, cut
    to ``block_size + 1``; the last ``val_fraction`` validates) and the vocabulary.

    >>> train, val, vocab = stdlib_paragraphs(block_size=32, max_chars=20_000)
    >>> min(train.lengths) >= 15 and max(train.lengths) == 32 and len(val) > 0
    True
    """
    vocab, text = _vocab_and_corpus(max_chars, val_fraction)
    texts = [p for p in re.split(r"\n[ ]*\n", text) if len(p.strip()) >= 16]
    if len(texts) < 2:
        raise EvendpError(f"max_chars={max_chars} gives under 2 paragraphs; raise max_chars")
    paragraphs = [vocab.encode(t) for t in texts]
    cut = min(len(paragraphs) - 1, max(1, len(paragraphs) - int(len(paragraphs) * val_fraction)))
    return (
        CodeParagraphs(paragraphs[:cut], block_size),
        CodeParagraphs(paragraphs[cut:], block_size),
        vocab,
    )
