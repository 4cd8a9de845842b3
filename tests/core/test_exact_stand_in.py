"""The stand-in batch (``_exact.py``): one real sample, marked through moves, unmarked by math."""

from __future__ import annotations

import copy
import pickle
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader

import evendp
from evendp._core._exact import StandInTensor, stand_in_batch

Pair = namedtuple("Pair", "x y")


def test_moves_and_copies_keep_the_mark_and_computations_drop_it() -> None:
    t = stand_in_batch(torch.ones(1, 3))
    kept = [t.to(torch.float64), t.clone(), t.detach(), t.contiguous(), t.cpu(), copy.deepcopy(t)]
    kept.append(pickle.loads(pickle.dumps(t)))
    assert all(isinstance(k, StandInTensor) for k in kept)
    dropped = [t * 2, t[:, 1:], t.sum(), torch.nn.functional.linear(t, torch.ones(2, 3))]
    assert not any(isinstance(d, StandInTensor) for d in dropped)
    assert torch.equal(t.as_subclass(torch.Tensor), torch.ones(1, 3))


def test_containers_keep_their_type() -> None:
    transformers = pytest.importorskip("transformers")
    encoding = transformers.BatchEncoding({"input_ids": torch.ones(1, 4, dtype=torch.long)})
    for batch in (
        {"a": torch.ones(1)},
        (torch.ones(1), 3),
        [torch.ones(1)],
        Pair(torch.ones(1), 1),
    ):
        marked = stand_in_batch(batch)
        assert type(marked) is type(batch) and evendp.is_stand_in(marked)
    marked = stand_in_batch(encoding)
    assert type(marked) is type(encoding) and evendp.is_stand_in(marked)
    assert not evendp.is_stand_in(encoding) and not evendp.is_stand_in(["text", 3])


def test_the_frameworks_device_moves_keep_the_mark() -> None:
    accelerate = pytest.importorskip("accelerate.utils")
    lightning = pytest.importorskip("lightning.pytorch.utilities")
    batch = stand_in_batch({"input_ids": torch.ones(1, 4), "labels": torch.ones(1)})
    cpu = torch.device("cpu")
    assert evendp.is_stand_in(accelerate.send_to_device(batch, cpu))
    assert evendp.is_stand_in(lightning.move_data_to_device(batch, cpu))


def test_empty_safe_collate_gives_a_stand_in_through_worker_processes() -> None:
    data = [(torch.full((3,), float(i)), i) for i in range(5)]
    collate = evendp.EmptySafeCollate(data, stand_in=True)
    loader = DataLoader(data, batch_sampler=[[], [1, 2]], collate_fn=collate, num_workers=1)
    (x0, y0), (x1, _) = list(loader)
    assert evendp.is_stand_in((x0, y0)) and x0.shape == (1, 3) and int(y0) == 0  # dataset[0]
    assert not evendp.is_stand_in(x1)
    x, _ = evendp.EmptySafeCollate(data)([])  # the default stays a zero-length batch
    assert x.shape == (0, 3) and not evendp.is_stand_in(x)


def test_a_real_gpt2_runs_a_stand_in_and_returns_plain_tensors() -> None:
    transformers = pytest.importorskip("transformers")
    from tests._helpers import tiny_gpt2_config

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    ids = torch.randint(1, 60, (1, 5))
    out = model(**stand_in_batch({"input_ids": ids, "labels": ids}))
    assert type(out.loss) is torch.Tensor and type(out.logits) is torch.Tensor
    assert torch.equal(out.loss, model(input_ids=ids, labels=ids).loss)
