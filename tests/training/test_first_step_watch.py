"""The first-step check registered by the Trainer: fake peak readers stand in for the GPU."""

from __future__ import annotations

import itertools

import pytest
import torch

from evendp import TrainConfig, Trainer
from evendp._training._first_step_watch import FirstStepWatch, first_step_watch
from evendp._training._recorder import Callbacks

from .test_trainer import TinyLM, _data, _flat, _rel


def _run(read: object) -> tuple[Trainer, list[list[list[int]]], float]:
    """Two steps of 12 samples on two virtual devices (6 each), the watch reading ``read``;
    the micro-steps of each step, and the parameters' distance to one device's two steps."""
    data = _data()
    torch.manual_seed(0)
    ours, ref = TinyLM(), TinyLM()
    ref.load_state_dict(ours.state_dict())
    cfg = TrainConfig(steps=2, batch_size=12, accum=1, grad_clip=None, progress=False)
    opt = torch.optim.SGD(ours.parameters(), lr=0.5)
    trainer = Trainer(ours, data, cfg, device_ids=["cpu"] * 2, optimizer=opt)
    assert not trainer.watches  # CPU devices: nothing planned on live GPUs, nothing watched
    # Planned 1000 B with a budget of 1100 B each (a plan on live GPUs would set these).
    trainer.watches = Callbacks([FirstStepWatch([1000, 1000], [1100, 1100], read=read)])  # type: ignore[list-item]
    batches = [data.batch(list(i)) for i in itertools.islice(trainer.sampler, 2)]
    seen: list[list[list[int]]] = []

    class Steps:
        def on_step_end(self, t: Trainer, step: int) -> None:
            seen.append([list(m) for m in t.micro_steps])

    trainer.callbacks = Callbacks([Steps()])
    trainer.fit()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in batches:
        ref_opt.zero_grad()
        ref(x, y).backward()
        ref_opt.step()
    return trainer, seen, _rel(_flat(ours), _flat(ref))


def test_a_device_over_its_plan_gets_a_lower_cap_and_the_same_gradient(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Device 1's first step reserved 1650 B, over its 1000 B plan: 6 * 1100 / 1650 = 4.
    trainer, seen, rel = _run(lambda devices: [900, 1650])
    assert trainer.guard.micro_batch_sizes == [None, 4]  # device 0, under its plan: untouched
    assert seen[0] == [[6, 6]] and seen[1] == [[6, 4], [0, 2]]  # lowered from step 2 on
    assert rel <= 1e-5  # one device on each whole batch, to fp32 round-off
    said = [line for line in capsys.readouterr().err.splitlines() if "first step" in line]
    assert len(said) == 1 and said[0].startswith("evendp: device 1 reserved 1.6 KiB")
    assert "micro-batches of at most 4 of its 6 samples" in said[0]


def test_devices_within_their_plan_and_a_failed_read_change_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    trainer, seen, rel = _run(lambda devices: [1000, None])
    assert trainer.guard.micro_batch_sizes == [None, None] and seen[1] == [[6, 6]]
    assert rel <= 1e-5

    def broken(devices: list[torch.device]) -> list[int | None]:
        raise RuntimeError("CUDA error: unspecified launch failure (injected)")

    trainer, seen, rel = _run(broken)
    assert trainer.guard.micro_batch_sizes == [None, None] and rel <= 1e-5
    said = [line for line in capsys.readouterr().err.splitlines() if "not checked" in line]
    assert said == [
        "evendp: the first step's memory was not checked: RuntimeError: CUDA error: "
        "unspecified launch failure (injected)"
    ]


def test_the_trainer_watches_cuda_devices_this_process_planned(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from evendp._planning import _on_device

    cuda = [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert first_step_watch(cuda) is None  # not planned here: nothing to compare with
    monkeypatch.setattr(_on_device, "_PLANNED", {"cuda:0": (10, 12), "cuda:1": (20, 24)})
    watch = first_step_watch(cuda)
    assert watch is not None and watch.check.planned == [10, 20] and watch.check.budgets == [12, 24]
    assert first_step_watch([cuda[0], cuda[0]]) is None  # replicas share one GPU's figure
    # Among ranks a cap lowered on one rank alone would change its micro-step count alone
    # (FSDP2 and DeepSpeed gather per micro-step): one process only (found in review).
    assert first_step_watch(cuda[:1], world=2) is None


def test_a_plan_made_before_the_trainer_is_not_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """An earlier plan on live GPUs in the same process (a notebook's, another model's) must
    not lower a later Trainer's caps: the Trainer starts from its own plans."""
    from evendp._planning import _on_device

    monkeypatch.setattr(_on_device, "_PLANNED", {"cuda:0": (10, 12)})
    Trainer(torch.nn.Linear(2, 1), [(torch.ones(2), torch.ones(1))] * 4,
            TrainConfig(steps=1, batch_size=2, progress=False))  # fmt: skip
    assert _on_device.planned_for("cuda:0") is None
