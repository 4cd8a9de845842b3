"""The built-in stdlib corpus: deterministic, fast, and windows that line up."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from evendp._core._errors import EvendpError
from evendp.examples.stdlib_text import CharVocab, CharWindows, load_corpus, stdlib_dataset


def test_corpus_is_deterministic_capped_and_fast(monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[Path] = []
    real_read = Path.read_text

    def counting(self: Path, *args: Any, **kwargs: Any) -> str:
        read.append(self)
        return real_read(self, *args, **kwargs)

    monkeypatch.setattr(Path, "read_text", counting)
    start = time.perf_counter()
    text = load_corpus(max_chars=1_000_000)
    elapsed = time.perf_counter() - start
    assert len(text) == 1_000_000
    # Capped: it read a prefix of the sorted files, not all of them.
    every = sorted(read[0].parent.glob("*.py"))
    assert read == every[: len(read)] and len(read) < len(every)
    # Fast: within a few times a plain read of those files and one pass over their characters,
    # measured here and now (a loaded machine slows both alike).
    start = time.perf_counter()
    raw = "".join(real_read(p, encoding="utf-8", errors="replace") for p in read)
    sum(1 for ch in raw if ch.isprintable())
    baseline = time.perf_counter() - start
    assert elapsed < 5 * baseline + 0.05, (elapsed, baseline)
    read.clear()
    assert text == load_corpus(max_chars=1_000_000)
    assert "def " in text and "import " in text


def test_corpus_from_a_folder_in_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "b.py").write_text("B\tb\n")
    (tmp_path / "a.py").write_text("A é\n")
    assert load_corpus(100, stdlib_dir=tmp_path) == "A \nB    b\n"


def test_empty_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EvendpError, match=r"no \.py files"):
        load_corpus(100, stdlib_dir=tmp_path)


def test_vocab_round_trip_and_unknown_characters() -> None:
    vocab = CharVocab()
    text = load_corpus(50_000)
    ids = vocab.encode(text)
    assert ids.dtype == torch.long and int(ids.max()) < vocab.size
    assert vocab.decode(ids) == text
    with pytest.raises(EvendpError, match="not in the vocabulary"):
        vocab.encode("π")


def test_windows_shift_by_one_and_batch_matches_getitem() -> None:
    train, val, _vocab = stdlib_dataset(block_size=8, max_chars=10_000)
    assert len(train) == len(train.data) - 8
    x, y = train[5]
    assert torch.equal(x[1:], y[:-1])
    xb, yb = train.batch([5, 0])
    assert torch.equal(xb[0], x) and torch.equal(yb[0], y)
    assert xb.shape == (2, 8)
    assert len(val) > 0


def test_bad_sizes_are_clear_errors() -> None:
    with pytest.raises(EvendpError, match="block_size"):
        CharWindows(torch.arange(5), block_size=5)
    with pytest.raises(EvendpError, match="max_chars"):
        load_corpus(0)


def test_paragraphs_are_variable_length_padded_with_ignored_labels() -> None:
    from evendp.examples.stdlib_text import IGNORE_INDEX, CodeParagraphs, stdlib_paragraphs

    train, val, vocab = stdlib_paragraphs(block_size=64, max_chars=100_000)
    assert len(set(train.lengths)) > 20 and max(train.lengths) == 64 and len(val) > 0
    short = min(range(len(train)), key=lambda i: train.lengths[i])
    x, y = train.batch([short, train.lengths.index(64)])
    assert x.shape == y.shape == (2, 64)
    n = train.lengths[short]
    assert (y[0, n:] == IGNORE_INDEX).all() and (y[0, :n] != IGNORE_INDEX).all()
    assert int(CodeParagraphs.count_tokens((x, y))) == n + 64
    # Targets are the next character of the same paragraph.
    assert vocab.decode(x[1, 1:]) == vocab.decode(y[1, :-1])


def test_gpt_loss_is_the_mean_over_real_tokens_only() -> None:
    from evendp.examples.gpt import GPT, GPTConfig
    from evendp.examples.stdlib_text import CodeParagraphs

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=8, block_size=6, n_layer=1, n_head=2, n_embd=8))
    data = CodeParagraphs([torch.randint(0, 8, (7,)), torch.randint(0, 8, (3,))], 6)
    x, y = data.batch([0, 1])
    logits, loss = model(x, y)
    per_token = torch.nn.functional.cross_entropy(logits.view(-1, 8), y.view(-1), reduction="none")
    real = y.view(-1) != -100
    assert loss is not None and torch.allclose(loss, per_token[real].mean())
    assert int(real.sum()) == 8 and float(per_token[~real].detach().abs().sum()) == 0.0


def test_paragraphs_bad_input_is_named() -> None:
    from evendp.examples.stdlib_text import CodeParagraphs

    with pytest.raises(EvendpError, match="2 or more characters"):
        CodeParagraphs([torch.arange(1)], block_size=4)
