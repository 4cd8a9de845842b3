"""``uneven_dataloader(batch_sizes="auto")`` in both integrations: the one meaning of "auto"
(each rank's share of ``batch_size * world`` planned from its memory, said in one line), the
same function ``UnevenTrainer`` and ``TrainConfig`` plan with. One process here: the ranks'
agreement is ``auto_batch_sizes``' own test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from accelerate import Accelerator
from transformers import GPT2Config, GPT2LMHeadModel

import evendp
from evendp._planning._balance import auto_batch_sizes
from evendp.integrations import accelerate as hf_accelerate
from evendp.integrations import lightning as pl_lightning

MEMORY = "4GiB"  # room for a GPU's CUDA context too: the test runs on GPU machines alike


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
    return GPT2LMHeadModel(config)


def rows(n: int = 20) -> list[dict[str, torch.Tensor]]:
    ids = [(torch.arange(8) * (i + 1)) % 64 for i in range(n)]
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def loaders() -> Iterator[tuple[str, Callable[..., Any]]]:
    yield (
        "accelerate",
        lambda *a, **k: hf_accelerate.uneven_dataloader(Accelerator(cpu=True), *a, **k),
    )
    yield "lightning", pl_lightning.uneven_dataloader


@pytest.mark.parametrize(("name", "build"), list(loaders()))
def test_auto_plans_the_model_on_a_sample_and_says_so(
    name: str, build: Callable[..., Any], capsys: pytest.CaptureFixture[str]
) -> None:
    model, data = tiny_gpt2(), rows()
    loader = build(data, "auto", model=model, batch_size=4, memory=MEMORY, shuffle=False)
    said = capsys.readouterr().err
    example = torch.utils.data.default_collate([data[0]])
    want, caps = auto_batch_sizes(model, example, global_batch=4, memory=MEMORY)
    assert f"evendp: batch_sizes='auto' planned {want} per rank" in said, said
    assert f"the most each holds: {caps}" in said
    assert [len(batch["input_ids"]) for batch in loader] == [want[0]] * 5


@pytest.mark.parametrize(("name", "build"), list(loaders()))
def test_auto_without_a_model_or_a_batch_size_is_refused_in_one_line(
    name: str, build: Callable[..., Any]
) -> None:
    with pytest.raises(evendp.EvendpError, match="no model was given; pass model="):
        build(rows(), "auto", batch_size=4, memory=MEMORY)
    with pytest.raises(evendp.EvendpError, match="batch_size=None; pass batch_size="):
        build(rows(), "auto", model=tiny_gpt2(), memory=MEMORY)
