"""Calibration on a live device and the first-step check, with fake measurements injected."""

from __future__ import annotations

import pytest
import torch

from evendp import InputError
from evendp._planning._on_device import (
    Calibration,
    FirstStepCheck,
    Line,
    calibrate,
    calibrated_split,
    calibration_sizes,
)
from evendp._training._oom import OomResplit
from evendp.examples.lm_head import LMHead, lm_loss


class _Fake:
    """A device whose allocator reserves ``fixed + per_sample * n``; it runs out past
    ``limit`` samples and counts what it was asked."""

    def __init__(self, fixed: int, per_sample: int, limit: int = 10**9) -> None:
        self.fixed, self.per_sample, self.limit = fixed, per_sample, limit
        self.asked: list[int] = []

    def reserved_after(self, n: int) -> int:
        self.asked.append(n)
        if n > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return self.fixed + self.per_sample * n

    def context_bytes(self) -> int:
        return 500 << 20


def test_calibration_fits_the_line_and_reads_the_context() -> None:
    fake = _Fake(fixed=1 << 30, per_sample=3 << 20)
    c = calibrate(fake, calibration_sizes(64))
    assert fake.asked == [8, 16]
    assert c == Calibration(Line(1 << 30, float(3 << 20), (8, 16)), 500 << 20)
    assert c.line.cap((1 << 30) + (30 << 20)) == 10


def test_a_failed_measurement_is_named_not_guessed() -> None:
    with pytest.raises(InputError, match=r"calibrating at 16 samples failed: OutOfMemoryError"):
        calibrate(_Fake(1 << 30, 3 << 20, limit=12), (8, 16))


def test_a_measurement_that_shrinks_is_refused() -> None:
    class Shared(_Fake):  # another process freed memory between the two steps
        def reserved_after(self, n: int) -> int:
            return 10**9 - n

    with pytest.raises(InputError, match="less memory at 16 samples"):
        calibrate(Shared(0, 0), (8, 16))
    with pytest.raises(InputError, match="two different batch sizes"):
        calibrate(_Fake(0, 1), (4, 4))


def test_first_step_over_its_plan_lowers_the_micro_batch_before_it_runs_out() -> None:
    # A device planned at 1 GiB for 16 samples whose first step reserved 1.25 GiB, over its
    # 1.1 GiB budget: the next step would run out past 14 samples at once (injected OOM).
    torch.manual_seed(0)
    net = LMHead(64, 8, n_embd=16)
    x, y = net.example_batch(16)

    def chunk_loss(start: int, stop: int) -> torch.Tensor:
        if stop - start > 14:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return lm_loss(net(x[start:stop]), y[start:stop])

    def step(guard: OomResplit) -> list[torch.Tensor]:
        net.zero_grad()
        guard.run(16, chunk_loss, weight=1 / 16, zero_grad=net.zero_grad)
        return [p.grad.clone() for p in net.parameters() if p.grad is not None]

    unchecked = OomResplit()
    step(unchecked)
    assert unchecked.resplits == 1  # without the check the device runs out, then re-splits

    gib = 1 << 30
    check = FirstStepCheck(planned=[gib], budgets=[int(1.1 * gib)])
    caps = check.check(measured=[int(1.25 * gib)], samples=[16])
    assert caps == [14] and len(check.notes) == 1 and "\n" not in check.notes[0]
    assert "device 0 reserved 1.25 GiB at its first step, over its plan" in check.notes[0]
    guard = OomResplit()
    check.apply(caps, guard.micro_batch_sizes)
    got = step(guard)
    assert guard.resplits == 0 and guard.micro_batch_sizes == [14]  # lowered in time
    net.zero_grad()
    lm_loss(net(x), y).backward()  # one device on the whole batch: the same gradient
    want = [p.grad for p in net.parameters() if p.grad is not None]
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7)


def test_first_step_within_its_plan_changes_nothing() -> None:
    check = FirstStepCheck(planned=[100, 100, 100], budgets=[120, 120, 120])
    sizes: list[int | None] = [None, 4, None]
    caps = check.check(measured=[100, 99, None], samples=[8, 8, 8])
    check.apply(caps, sizes)
    assert caps == [None, None, None] and sizes == [None, 4, None] and check.notes == []
    # An over-plan device keeps a smaller cap it already had (e.g. from an earlier OOM).
    check.apply(check.check(measured=[100, 119 * 2, 100], samples=[8, 8, 8]), sizes)
    assert sizes == [None, 4, None]
    with pytest.raises(InputError, match="one budget per planned device"):
        FirstStepCheck(planned=[1, 2], budgets=[3])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibration_and_the_reserved_plan_on_a_real_gpu() -> None:  # pragma: no cover
    # --- GPU-only: the real allocator against the line and the model. ---
    from evendp._planning._allocator import AllocatorConfig, CudaAllocatorModel, reserved_peak
    from evendp._planning._measure import make_setup, measure_replica
    from evendp._planning._on_device import CudaMeasurer

    net = LMHead(8_000, 64, n_embd=128).cuda()
    opt = torch.optim.AdamW(net.parameters())

    def step(n: int) -> None:
        x, y = (t.cuda() for t in net.example_batch(n))
        lm_loss(net(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    c = calibrate(CudaMeasurer(0, step), (8, 16))
    assert c.line.per_sample > 0 and c.context > 0
    real = CudaMeasurer(0, step).reserved_after(32)
    assert c.line.at(32) <= real * 1.10  # a convex peak: the line from below, near it
    setup = make_setup(lambda: LMHead(8_000, 64, n_embd=128), net.example_batch(2), lm_loss,
                       torch.optim.AdamW, None, False)  # fmt: skip
    trace = measure_replica(setup, 32, "keep").trace
    assert trace is not None
    # The real figure holds everything reserved: parameters, optimizer state, the two cuBLAS
    # workspaces (made by the calibration's steps, kept since) and the step's blocks.
    planned = reserved_peak(trace, major=CudaAllocatorModel.live(0).major,
                            config=AllocatorConfig.current()).planned  # fmt: skip
    assert real <= planned <= 1.25 * real  # never under the real allocator


def test_the_measured_line_only_ever_lowers_a_planned_share() -> None:
    mib = 1 << 20
    steep = calibrate(_Fake(fixed=1000 * mib, per_sample=100 * mib), (2, 4))  # more than planned
    flat = calibrate(_Fake(fixed=1000 * mib, per_sample=10 * mib), (2, 4))  # less than planned
    split, notes = calibrated_split([20, 20, 20], [4000 * mib] * 3, [steep, flat, None])
    # steep: (4000 - 500 context - 1000) / 100 = 25 >= 20 kept; flat keeps its 20 too.
    assert split == [20, 20, 20] and notes == []
    split, notes = calibrated_split([20, 20], [2500 * mib] * 2, [steep, flat])
    assert split == [10, 20] and len(notes) == 1 and notes[0].startswith("evendp: device 0")


# --- The calibration wired into plan(): the one hook every planning surface passes through.


class _Line:
    """A device measured at ``fixed + per_sample * n`` (context 0); ``fail`` raises."""

    def __init__(self, fixed: int, per_sample: int, fail: bool = False) -> None:
        self.fixed, self.per_sample, self.fail = fixed, per_sample, fail
        self.asked: list[int] = []

    def reserved_after(self, n: int) -> int:
        self.asked.append(n)
        if self.fail:
            raise RuntimeError("CUDA error: an illegal memory access (injected)")
        return self.fixed + self.per_sample * n

    def context_bytes(self) -> int:
        return 0


@pytest.fixture
def live(monkeypatch: pytest.MonkeyPatch) -> dict[int, _Line]:
    """Every device planned counts as a live CUDA device measured by ``fakes[i]`` (roomy
    unless a test sets it): the path a GPU machine takes, with chosen figures."""
    from evendp._planning import _on_device

    fakes: dict[int, _Line] = {}
    monkeypatch.setattr(_on_device, "live_cuda", lambda names: list(range(len(names))))
    monkeypatch.setattr(
        _on_device, "measurer", lambda i, step: fakes.setdefault(i, _Line(1 << 20, 1))
    )
    return fakes


def _lm() -> tuple[LMHead, tuple[torch.Tensor, torch.Tensor]]:
    net = LMHead(512, 16, n_embd=32)
    return net, net.example_batch(1)


def test_plan_on_live_devices_is_lowered_to_the_measured_line(
    live: dict[int, _Line], capsys: pytest.CaptureFixture[str]
) -> None:
    from evendp import plan

    net, batch = _lm()
    kw = dict(mode="ddp", criterion=lm_loss, cuda_context=0)
    before = plan(net, batch, "64MiB,64MiB", calibrate=False, **kw)  # type: ignore[arg-type]
    budget, alone = before.devices[1].budget, before.devices[1].max_batch_alone
    # Device 1 measures twice the model's bytes per sample: half its samples fit.
    live[1] = _Line(fixed=0, per_sample=2 * budget // alone)
    after = plan(net, batch, "64MiB,64MiB", **kw)  # type: ignore[arg-type]
    assert live[1].asked == list(calibration_sizes(alone))  # two small sizes, real steps
    want = budget // (2 * budget // alone)
    assert after.devices[1].max_batch_alone == want < alone
    assert after.devices[0].max_batch_alone == before.devices[0].max_batch_alone  # roomy: kept
    assert after.split == [d.samples for d in after.devices] and after.global_batch == sum(
        after.split
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("evendp: device 1 measured")
    assert f"{want} samples fit, not {alone}" in lines[0]


def test_a_failed_calibration_is_said_not_guessed(live: dict[int, _Line]) -> None:
    from evendp import plan

    net, batch = _lm()
    live[0] = _Line(0, 1, fail=True)
    with pytest.raises(InputError) as err:
        plan(net, batch, "64MiB", mode="ddp", criterion=lm_loss, cuda_context=0)
    text = str(err.value)
    assert "\n" not in text and text.startswith("calibrating device 0 (dev0) on the real model")
    assert "RuntimeError: CUDA error: an illegal memory access (injected)" in text
    assert "calibrate=False" in text


def test_cpu_devices_are_not_measured_and_true_asks_for_gpus() -> None:
    from evendp import plan

    net, batch = _lm()
    p = plan(net, batch, "64MiB", mode="ddp", criterion=lm_loss, cuda_context=0)
    q = plan(net, batch, "64MiB", mode="ddp", criterion=lm_loss, cuda_context=0, calibrate=False)
    assert p.split == q.split and p.devices[0].max_batch_alone == q.devices[0].max_batch_alone
    with pytest.raises(InputError, match=r"calibrate=True measures live CUDA devices"):
        plan(net, batch, "64MiB", mode="ddp", criterion=lm_loss, cuda_context=0, calibrate=True)
    with pytest.raises(InputError, match="2 measurers for 1 devices"):
        plan(net, batch, "64MiB", mode="ddp", criterion=lm_loss, cuda_context=0,
             calibrate=[None, None])  # fmt: skip


def test_batch_sizes_auto_and_weights_auto_pass_through_the_calibration(
    live: dict[int, _Line],
) -> None:
    # A padded tiny GPT-2 (the transformers model), as batch_sizes="auto" (per rank) and
    # weights="auto" (one process, DP) plan it: both reach the hook in plan().
    from transformers import GPT2Config, GPT2LMHeadModel

    from evendp._planning._balance import auto_batch_sizes, device_weights_for_memory

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=32)
    gpt = GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 128, (1, 16))
    batch = {"input_ids": ids, "labels": ids.masked_fill(torch.arange(16) >= 12, -100)}
    live[0] = _Line(fixed=0, per_sample=1)  # roomy: nothing changes
    _, roomy = auto_batch_sizes(gpt, batch, memory="32MiB", cuda_context=0)
    live.clear()
    live[0] = _Line(fixed=8 << 20, per_sample=1 << 20)  # 1 MiB a sample past 8 MiB
    sizes, caps = auto_batch_sizes(gpt, batch, global_batch=4, memory="32MiB", cuda_context=0)
    # The budget is 32 MiB less the 5% margin: (30.4 - 8) MiB at 1 MiB a sample is 22.
    assert caps == [min(roomy[0], 22)] and caps[0] < roomy[0] and sizes == [4]

    cpu = [torch.device("cpu")] * 2
    live.clear()
    even, _ = device_weights_for_memory(gpt, ids, cpu, memory="32MiB,32MiB", environ={})
    live.clear()
    live[1] = _Line(fixed=16 << 20, per_sample=4 << 20)  # device 1 holds few samples
    lowered, _ = device_weights_for_memory(gpt, ids, cpu, memory="32MiB,32MiB", environ={})
    assert lowered[0] == even[0] and lowered[1] < even[1]


def test_token_caps_follow_a_lowered_device(live: dict[int, _Line]) -> None:
    from evendp import plan

    net, batch = _lm()
    kw = dict(mode="ddp", criterion=lm_loss, cuda_context=0, seq_len=16)
    before = plan(net, batch, "64MiB", calibrate=False, **kw)  # type: ignore[arg-type]
    live[0] = _Line(
        fixed=0, per_sample=4 * before.devices[0].budget // before.devices[0].max_batch_alone
    )
    after = plan(net, batch, "64MiB", **kw)  # type: ignore[arg-type]
    alone = after.devices[0].max_batch_alone
    assert alone < before.devices[0].max_batch_alone
    assert after.max_tokens == [after.devices[0].max_tokens] and after.max_tokens[0] <= alone * 16
    assert before.max_tokens is not None and after.max_tokens[0] < before.max_tokens[0]


class _Stepping(_Line):
    """A device measured as :class:`_Line`'s whose measurement takes real optimizer steps,
    as :class:`~evendp._planning._on_device.CudaMeasurer`'s does (on the CPU here)."""

    def __init__(self, fixed: int, per_sample: int) -> None:
        super().__init__(fixed, per_sample)
        self.net = torch.nn.Linear(4, 1)
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.1)

    def reserved_after(self, n: int) -> int:
        self.net(torch.randn(n, 4)).sum().backward()
        self.opt.step()
        self.opt.zero_grad()
        return super().reserved_after(n)


def test_calibrating_under_evendp_launch_is_not_the_scripts_first_step(
    live: dict[int, _Line],
    tmp_path: object,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A launched script that plans on live GPUs before it reads EVENDP_BATCH_SIZES: the
    calibration's real optimizer steps tripped the launcher's first-step hook (a false
    "unported" warning; under --strict every rank ended, exit 2), and so did the planner's
    step on fake tensors, whose hook removal beside MemTracker's hooks failed the plan
    ("OrderedDict mutated during iteration"). The hook is armed here as a launched rank's
    wrapper arms it; it waits for the script's own first step."""
    import torch.optim.optimizer as optimizer_module

    from evendp import plan
    from evendp._distributed import _first_step, _launch_notes

    monkeypatch.setattr(_launch_notes, "_read_here", False)
    monkeypatch.setattr(_first_step, "_SAMPLED", set())
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "4")
    monkeypatch.setenv("EVENDP_OUTCOME", f"{tmp_path}/outcome.json")
    monkeypatch.setenv("RANK", "0")
    hook = _first_step._FirstStep()
    hook.handle = optimizer_module.register_optimizer_step_pre_hook(hook)
    try:
        live[0] = _Stepping(1 << 20, 1)
        net, batch = _lm()
        plan(net, batch, "64MiB", mode="ddp", criterion=lm_loss, cuda_context=0)
        assert len(live[0].asked) == 2  # two measurements, each with real optimizer steps
        assert "first optimizer step" not in capsys.readouterr().err
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        later = optimizer_module.register_optimizer_step_pre_hook(lambda *args: None)
        try:  # a library's global hook after the launcher's, as MemTracker's was
            for _ in range(2):
                lm_loss(net(batch[0]), batch[1]).backward()
                opt.step()  # the script's own first step, the sizes unread: told, once
        finally:
            later.remove()
        told = [line for line in capsys.readouterr().err.splitlines() if "first optim" in line]
        assert len(told) == 1 and told[0].startswith("evendp launch: warning: the script took")
    finally:
        if hook.handle is not None:
            hook.handle.remove()
