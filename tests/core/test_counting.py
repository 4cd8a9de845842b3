"""``count_tokens`` and the rule that recognises a Hugging Face model's label count."""

from __future__ import annotations

import pytest
import torch

import evendp
from evendp._core._counting import auto_count, label_shift
from evendp._core._exact import stand_in_batch

LABELS = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100], [-100, -100, -100, -100]])


def test_count_tokens_finds_the_labels_wherever_a_count_fn_gets_them() -> None:
    shifted = evendp.count_tokens(shift=True)
    assert int(shifted(labels=LABELS)) == 3  # keywords (BalancedDataParallel(**batch))
    assert int(shifted({"input_ids": LABELS, "labels": LABELS})) == 3  # a dict batch
    assert int(shifted((torch.zeros(3, 4), LABELS))) == 3  # an (inputs, targets) batch
    assert int(shifted(torch.zeros(3, 4, 9), LABELS)) == 3  # (output, targets)
    assert int(shifted(LABELS)) == 3  # StepMean.weigh(loss, labels)
    assert int(evendp.count_tokens(shift=False)(LABELS)) == 5
    assert int(evendp.count_tokens(shift=False, ignore_index=7)(LABELS)) == 11
    assert int(evendp.count_tokens(shift=False, key="y")(y=LABELS, labels=None)) == 5
    assert int(evendp.count_tokens(shift=False)(labels=torch.rand(3, 2))) == 6  # multi-label
    assert shifted(stand_in_batch({"labels": LABELS[:1]})) == 0
    assert repr(shifted) == "count_tokens(shift=True)"


def test_count_tokens_refuses_bad_arguments_and_missing_labels() -> None:
    with pytest.raises(evendp.EvendpError, match="shift must be True"):
        evendp.count_tokens(shift="yes")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        evendp.count_tokens()  # type: ignore[call-arg]  # no default: the shift is a choice
    with pytest.raises(evendp.EvendpError, match="found no labels"):
        evendp.count_tokens(shift=False)({"input_ids": [1, 2]})


def test_real_hugging_face_classes_are_recognised_by_their_task() -> None:
    transformers = pytest.importorskip("transformers")
    bert = transformers.BertConfig(
        vocab_size=32, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=8, max_position_embeddings=16,
    )  # fmt: skip
    gpt2 = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    assert label_shift(transformers.GPT2LMHeadModel(gpt2)) is True
    assert label_shift(transformers.BertForMaskedLM(bert)) is False
    assert label_shift(transformers.BertForTokenClassification(bert)) is False
    assert label_shift(transformers.GPT2ForSequenceClassification(gpt2)) is False
    assert label_shift(transformers.GPT2DoubleHeadsModel(gpt2)) is None  # two losses: unknown
    assert label_shift(transformers.BertModel(bert)) is None
    assert label_shift(torch.nn.Linear(2, 2)) is None
    count = auto_count(transformers.BertForMaskedLM(bert))
    assert count is not None and int(count(labels=LABELS)) == 5
    assert count(input_ids=torch.ones(3, 4)) == 3  # no labels: the rows
