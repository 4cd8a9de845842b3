"""Checkpoints: round trip, atomic replace keeping the previous one, strict and harmless loads."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from evendp._core._errors import EvendpError
from evendp._training._checkpoint import (
    load_checkpoint,
    previous_path,
    resumable_checkpoint,
    save_checkpoint,
)


def _setup(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, object]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    sched.step()
    return model, opt, sched


def test_round_trip_restores_everything(tmp_path: Path) -> None:
    model, opt, sched = _setup(0)
    path = tmp_path / "ckpt.pt"
    torch.manual_seed(123)
    random.seed(7)
    save_checkpoint(path, model=model, optimizer=opt, scheduler=sched, step=5, extra={"epoch": 2})
    expected_torch = torch.rand(3)
    expected_py = random.random()

    other, other_opt, other_sched = _setup(1)
    info = load_checkpoint(path, model=other, optimizer=other_opt, scheduler=other_sched)
    assert info == {"step": 5, "extra": {"epoch": 2}}
    for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert other_opt.state_dict()["state"][0]["exp_avg"].equal(
        opt.state_dict()["state"][0]["exp_avg"]
    )
    assert other_sched.state_dict() == sched.state_dict()
    assert torch.equal(torch.rand(3), expected_torch)  # RNG streams continue where they were
    assert random.random() == expected_py


def test_second_save_keeps_the_previous_good_checkpoint(tmp_path: Path) -> None:
    model, opt, _ = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=opt, step=1)
    save_checkpoint(path, model=model, optimizer=opt, step=2)
    assert load_checkpoint(path, model=model)["step"] == 2
    assert load_checkpoint(previous_path(path), model=model)["step"] == 1
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]
    path.unlink()  # as if a crash came between the two renames
    assert resumable_checkpoint(path)[0] == previous_path(path)  # type: ignore[index]


def test_corrupt_file_is_a_clear_error_and_nothing_is_touched(tmp_path: Path) -> None:
    model, opt, _ = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=opt, step=1)
    save_checkpoint(path, model=model, optimizer=opt, step=2)
    good_prev = previous_path(path).read_bytes()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # truncated, as by an interrupted copy
    corrupt = path.read_bytes()
    before = {k: v.clone() for k, v in model.state_dict().items()}

    with pytest.raises(EvendpError) as info:
        load_checkpoint(path, model=model, optimizer=opt)
    message = str(info.value)
    assert str(path) in message and "unreadable" in message and "ckpt.prev.pt" in message
    assert path.read_bytes() == corrupt
    assert previous_path(path).read_bytes() == good_prev
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    assert load_checkpoint(previous_path(path), model=model)["step"] == 1


def test_garbage_and_foreign_files(tmp_path: Path) -> None:
    model, _, _ = _setup()
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a checkpoint at all")
    with pytest.raises(EvendpError, match="unreadable"):
        load_checkpoint(junk, model=model)
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(1)}, foreign)
    with pytest.raises(EvendpError, match="not an evendp checkpoint"):
        load_checkpoint(foreign, model=model)
    with pytest.raises(EvendpError, match="no checkpoint"):
        load_checkpoint(tmp_path / "missing.pt", model=model)


def test_mismatched_model_names_keys_and_shapes_and_changes_nothing(tmp_path: Path) -> None:
    model, _, _ = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model)
    wider = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    before = [p.clone() for p in wider.parameters()]
    with pytest.raises(EvendpError, match=r"shape mismatches.*0\.weight") as info:
        load_checkpoint(path, model=wider)
    assert str(path) in str(info.value)
    assert all(torch.equal(a, b) for a, b in zip(before, wider.parameters(), strict=True))
    with pytest.raises(EvendpError, match="missing keys"):
        load_checkpoint(
            path,
            model=torch.nn.Sequential(torch.nn.Linear(4, 8))
            .append(torch.nn.ReLU())
            .append(torch.nn.Linear(8, 2))
            .append(torch.nn.Linear(2, 2)),
        )


def test_optimizer_mismatch_is_caught_before_loading(tmp_path: Path) -> None:
    model, opt, _ = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=opt)
    split = torch.optim.SGD([{"params": [model[0].weight]}, {"params": [model[0].bias]}], lr=0.1)
    with pytest.raises(EvendpError, match="parameter groups"):
        load_checkpoint(path, model=model, optimizer=split)
    save_checkpoint(tmp_path / "model_only.pt", model=model)
    with pytest.raises(EvendpError, match="no optimizer state"):
        load_checkpoint(tmp_path / "model_only.pt", model=model, optimizer=opt)


def test_failed_write_leaves_existing_files_and_no_temp(tmp_path: Path) -> None:
    model, _, _ = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, step=1)
    good = path.read_bytes()

    class Unpicklable:
        def __reduce__(self) -> tuple[object, ...]:
            raise RuntimeError("cannot pickle")

    with pytest.raises(RuntimeError, match="cannot pickle"):
        save_checkpoint(path, model=model, step=2, extra={"bad": Unpicklable()})
    assert path.read_bytes() == good
    assert not previous_path(path).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_each_rank_restores_its_own_rng_only_for_the_same_step(tmp_path: Path) -> None:
    from evendp._training._checkpoint import rank_rng_path
    from tests.training._rank_rng import load_rank_rng, save_rank_rng

    ckpt = tmp_path / "ckpt.pt"
    torch.manual_seed(11)
    save_rank_rng(ckpt, rank=1, step=4)
    expected = torch.rand(3)  # what rank 1 draws next after step 4
    torch.manual_seed(99)  # resume starts from the writer's (another) state
    with pytest.warns(UserWarning, match="holds step 4"):
        assert not load_rank_rng(ckpt, rank=1, step=5)  # another step's state is not applied
    with pytest.warns(UserWarning, match="is missing"):
        assert not load_rank_rng(ckpt, rank=2, step=4)  # no file for rank 2
    assert load_rank_rng(ckpt, rank=1, step=4)
    torch.testing.assert_close(torch.rand(3), expected)
    rank_rng_path(ckpt, 1).write_bytes(b"garbage")
    with pytest.raises(EvendpError, match=r"ckpt.rng1.pt.*delete it"):
        load_rank_rng(ckpt, rank=1, step=4)


# -- verified checkpoints (issue 22) ------------------------------------------------------------


def _garble_tensor(path: Path, tensor: torch.Tensor) -> None:
    """Overwrite ``tensor``'s stored bytes in the file: the zip stays readable."""
    data = path.read_bytes()
    raw = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    at = data.index(raw)
    garbled = bytes(random.Random(1).randbytes(len(raw)))
    path.write_bytes(data[:at] + garbled + data[at + len(raw) :])


def test_garbled_tensor_data_is_caught_by_the_checksum(tmp_path: Path) -> None:
    from evendp._training._checkpoint import CorruptCheckpoint

    model, opt, _ = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=opt, step=3)
    _garble_tensor(path, model[0].weight)
    torch.load(path, weights_only=True)  # torch reads it without complaint
    with pytest.raises(CorruptCheckpoint, match=r"ckpt\.pt.*sha256.*ckpt\.prev\.pt"):
        load_checkpoint(path, model=model, optimizer=opt)


def test_old_checkpoints_without_a_checksum_still_load(tmp_path: Path) -> None:
    from evendp._training._checkpoint import UNVERIFIED

    model, _, _ = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, step=2)
    payload = torch.load(path, weights_only=True)
    assert {"step", "model", "sha256"} <= payload.keys()  # still a plain dict
    del payload["sha256"]
    torch.save(payload, path)
    assert load_checkpoint(path, model=model)["step"] == 2
    assert str(path) in UNVERIFIED


def test_non_finite_state_is_never_written(tmp_path: Path) -> None:
    from evendp._core._errors import TrainingError

    model, opt, _ = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=opt, step=1)
    good = path.read_bytes()
    with torch.no_grad():
        model[2].bias[0] = float("nan")
    with pytest.raises(TrainingError, match=r"model\.2\.bias holds NaN or inf.*ckpt\.pt"):
        save_checkpoint(path, model=model, optimizer=opt, step=2)
    assert path.read_bytes() == good and not previous_path(path).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_a_bad_previous_checkpoint_never_points_to_prev_prev(tmp_path: Path) -> None:
    from evendp._training._checkpoint import CorruptCheckpoint

    model, _, _ = _setup()
    prev = previous_path(tmp_path / "ckpt.pt")
    prev.write_bytes(b"garbage")
    with pytest.raises(CorruptCheckpoint) as info:
        load_checkpoint(prev, model=model)
    assert "prev.prev" not in str(info.value) and "last fallback" in str(info.value)


def test_rank_rng_prefers_the_exact_previous_state_over_a_reseed(tmp_path: Path) -> None:
    from tests.training._rank_rng import load_rank_rng, save_rank_rng

    ckpt = tmp_path / "ckpt.pt"
    torch.manual_seed(5)
    save_rank_rng(ckpt, rank=1, step=10)
    expected = torch.rand(3)
    save_rank_rng(ckpt, rank=1, step=12)  # rank 0 died before writing its step-12 ckpt.pt
    torch.manual_seed(99)
    assert load_rank_rng(ckpt, rank=1, step=10, reseed=7)  # from ckpt.prev.rng1.pt, exactly
    torch.testing.assert_close(torch.rand(3), expected)


def _tmpfs(where: Path, size: str) -> Path:
    import subprocess

    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)])
    if done.returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): no real full disk to test")
    return where


@pytest.fixture
def small_disk(tmp_path: Path):  # type: ignore[no-untyped-def]
    import subprocess

    disk = _tmpfs(tmp_path / "disk", "3m")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(small_disk: Path) -> None:
    from evendp._core._errors import TrainingError

    model = torch.nn.Linear(400, 400)  # 640 KB: the third copy does not fit 3 MiB with AdamW
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 400)).sum().backward()
    opt.step()
    path = small_disk / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=opt, step=1)  # 1.9 MB
    with pytest.raises(TrainingError, match=r"ckpt\.pt.*No space left on device.*--resume"):
        save_checkpoint(path, model=model, optimizer=opt, step=2)
    assert load_checkpoint(path, model=model)["step"] == 1
    assert sorted(p.name for p in small_disk.iterdir()) == ["ckpt.pt"]  # no temp file left


def test_a_read_only_folder_is_one_line(small_disk: Path) -> None:
    import subprocess

    from evendp._core._errors import TrainingError

    model, _, _ = _setup()
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    with pytest.raises(TrainingError, match=r"Read-only file system.*another --out"):
        save_checkpoint(small_disk / "ckpt.pt", model=model, step=1)
    with pytest.raises(TrainingError, match=r"could not create the folder.*Read-only"):
        save_checkpoint(small_disk / "sub" / "ckpt.pt", model=model, step=1)
