"""The tiny classification task the Accelerate and Lightning checks share, and its reference."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SAMPLES = 10  # steps of 4, 4, 2 with sizes [1, 3]: the short last step is uneven too
ACCUM = 2
EPOCHS = 2
LR = 0.5
SEED = 7


class Data(torch.utils.data.Dataset):
    """Ten samples of 4 features and a class out of 3; items carry their index."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.x = torch.randn(SAMPLES, 4, generator=g)
        self.y = torch.randint(0, 3, (SAMPLES,), generator=g)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def reference_update_error(seen: Sequence[list[list[list[int]]]], got: list[torch.Tensor]) -> float:
    """||got - want|| / ||want - start||, ``want`` from one process on the same windows.

    ``seen[rank][epoch][micro_step]`` are the indices a rank trained on; one optimizer step
    covers ``ACCUM`` micro-steps of all ranks, with the mean loss over all their samples.
    """
    start = [p.detach() for p in make_model().parameters()]
    want, _ = reference_run(seen)
    return _norm([g - w for g, w in zip(got, want, strict=True)]) / _norm(
        [w - s for w, s in zip(want, start, strict=True)]
    )


def warmup(step: int) -> float:
    """The learning-rate factor of a 3-step linear warm-up (LambdaLR's ``lr_lambda``)."""
    return min(1.0, (step + 1) / 3)


def reference_run(
    seen: Sequence[list[list[list[int]]]],
    accum: int = ACCUM,
    lrs: list[float] | None = None,
) -> tuple[list[torch.Tensor], list[float]]:
    """One process on the windows ``seen`` describes: final parameters and each step's loss.

    With ``lrs`` (a list to fill) the learning rate follows :func:`warmup`, one scheduler
    step per optimizer step, and each optimizer step's rate is appended to it.
    """
    data, model = Data(), make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup if lrs is not None else _one)
    losses = []
    for epoch in range(len(seen[0])):
        steps = list(zip(*(rank[epoch] for rank in seen), strict=True))
        for w in range(0, len(steps), accum):
            idx = list(itertools.chain.from_iterable(itertools.chain(*steps[w : w + accum])))
            loss = F.cross_entropy(model(data.x[idx]), data.y[idx])
            loss.backward()
            losses.append(float(loss.detach()))
            if lrs is not None:
                lrs.append(optimizer.param_groups[0]["lr"])
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return [p.detach() for p in model.parameters()], losses


def _one(step: int) -> float:
    return 1.0


class RejectsEmpty(nn.Module):
    """The tiny net, refusing a batch of 0 rows as GPT-2 and BERT do (they cannot reshape it)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 0:
            raise RuntimeError("cannot reshape tensor of 0 elements")
        return self.net(x)


def _norm(tensors: list[Any]) -> float:
    return float(sum(float(t.norm() ** 2) for t in tensors)) ** 0.5
