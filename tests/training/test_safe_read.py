"""The hostile-checkpoint corpus (issue 28): every file kind evendp reads back, holding a pickle
that would run code, a zip bomb, or fields of the wrong kind, range or shape (with a valid
digest). Each is refused in one line naming the file and the field, never a traceback, and no
marker file is created; a resume falls back to the previous good checkpoint."""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from evendp._core._digest import content_digest
from evendp._core._errors import CheckpointError
from evendp._training._checkpoint import (
    CorruptCheckpoint,
    _check_shard_shapes,
    load_checkpoint,
    previous_path,
    rank_rng_path,
    resumable_checkpoint,
    save_checkpoint,
)
from evendp._training._safe_read import Refused, check_archive, safe_dcp
from tests.training._rank_rng import load_rank_rng, read_rng, save_rank_rng


class _Payload:
    """Unpickles into ``os.system("touch MARKER")``: what a hostile file would run."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _setup() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


def _rewrite(path: Path, change: Any) -> None:
    """Apply ``change`` to the saved payload and write it back with a recomputed digest."""
    payload = torch.load(path, weights_only=True)
    change(payload)
    payload["sha256"] = content_digest(payload)
    torch.save(payload, path)


def _one_line(error: BaseException, *needles: str) -> str:
    message = str(error)
    assert "\n" not in message and "Traceback" not in message
    for needle in needles:
        assert needle in message, (needle, message)
    return message


def _deflated(path: Path) -> None:
    """The same archive with its entries compressed: a zip bomb's form (torch reads it)."""
    with zipfile.ZipFile(path) as z:
        entries = [(i.filename, z.read(i)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in entries:
            z.writestr(name, data)


BAD_FIELDS = {
    "step": lambda p: p.update(step="abc"),
    "step ": lambda p: p.update(step=-5),
    "extra.epoch": lambda p: p["extra"].update(epoch=1e30),
    "extra.micro_batch_sizes.0": lambda p: p["extra"].update(micro_batch_sizes=[-3, -3]),
    "extra.samples": lambda p: p["extra"].update(samples="many"),
    "optimizer.param_groups.0.lr": lambda p: p["optimizer"]["param_groups"][0].update(lr="fast"),
    "optimizer.state.0.exp_avg": lambda p: p["optimizer"]["state"][0].update(
        exp_avg=torch.zeros(3, 3)
    ),
    "rng.torch": lambda p: p["rng"].update(torch=torch.zeros(3)),
}


@pytest.mark.parametrize("field", BAD_FIELDS)
def test_a_checkpoint_with_bad_fields_is_refused_naming_the_field(
    field: str, tmp_path: Path
) -> None:
    model, opt = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=opt, step=3, extra={"epoch": 0, "samples": [1]})
    save_checkpoint(path, model=model, optimizer=opt, step=4, extra={"epoch": 0, "samples": [1]})
    _rewrite(path, BAD_FIELDS[field])
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(CorruptCheckpoint) as info:
        load_checkpoint(path, model=model, optimizer=opt)
    _one_line(info.value, str(path), f"field {field.strip()}")
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    if not field.startswith("optimizer"):  # read without the optimizer: the resume's first look
        found, step, _ = resumable_checkpoint(path)  # type: ignore[misc]
        assert (found, step) == (previous_path(path), 3)  # falls back as for a corrupt file


@pytest.mark.parametrize("kind", ["checkpoint", "rng"])
@pytest.mark.parametrize("attack", ["pickle", "bomb", "legacy"])
def test_hostile_files_are_refused_in_one_line_and_run_nothing(
    kind: str, attack: str, tmp_path: Path
) -> None:
    model, opt = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=opt, step=2)
    save_rank_rng(path, rank=1, step=2)
    target = path if kind == "checkpoint" else rank_rng_path(path, 1)
    marker = tmp_path / "marker"
    if attack == "pickle":
        torch.save({"format": "evendp-checkpoint", "step": _Payload(marker)}, target)
    elif attack == "bomb":
        _deflated(target)
    else:  # the legacy format reads storage sizes from the file and allocates them
        torch.save(torch.load(target, weights_only=True), target,
                   _use_new_zipfile_serialization=False)  # fmt: skip
    with pytest.raises(CheckpointError) as info:
        if kind == "checkpoint":
            load_checkpoint(path, model=model, optimizer=opt)
        else:
            load_rank_rng(path, rank=1, step=2)
    _one_line(info.value, str(target))
    assert not marker.exists()


def test_an_archive_that_unpacks_past_its_size_or_limit_is_refused(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data/0", bytes(20 << 20))  # 20 MB of zeros in about 20 KB
    assert len(buffer.getvalue()) < 100_000
    with pytest.raises(Refused, match="compressed"):
        check_archive(buffer)
    stored = tmp_path / "big.pt"
    torch.save({"w": torch.zeros(1000)}, stored)
    check_archive(stored)
    with pytest.raises(Refused, match="more than 100"):
        check_archive(stored, limit=100)


# -- FSDP2's folders (torch.distributed.checkpoint), without a process group -------------------


def _dcp_folder(tmp_path: Path) -> tuple[Path, torch.nn.Module, torch.optim.Optimizer]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = _setup()
    folder = tmp_path / "ckpt.dcp"
    model_state, optim_state = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no process group: DCP says so
        dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder),
                 no_dist=True)  # fmt: skip
    return folder, model, opt


def _point_item(folder: Path, fqn: str, value: Any) -> None:
    """Append a pickle of ``value`` to the item file and point ``fqn``'s entry at it."""
    with (folder / ".metadata").open("rb") as f:
        metadata = pickle.load(f)  # the test's own file
    key = next(k for k in metadata.storage_data if k.fqn == fqn)
    info = metadata.storage_data[key]
    buffer = io.BytesIO()
    torch.save(value, buffer)
    item = folder / info.relative_path
    offset = item.stat().st_size
    with item.open("ab") as f:
        f.write(buffer.getvalue())
    metadata.storage_data[key] = dataclasses.replace(
        info, offset=offset, length=len(buffer.getvalue())
    )
    with (folder / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)


def _safe_load(folder: Path, model: torch.nn.Module, opt: torch.optim.Optimizer) -> Any:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    reader, planner = safe_dcp()
    model_state, optim_state = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load({"model": model_state, "optimizer": optim_state},
                 storage_reader=reader(str(folder)), planner=planner(), no_dist=True)  # fmt: skip
    return optim_state


def test_a_hostile_dcp_metadata_is_refused_and_runs_nothing(tmp_path: Path) -> None:
    folder, model, _ = _dcp_folder(tmp_path)
    marker = tmp_path / "marker"
    with (folder / ".metadata").open("wb") as f:
        pickle.dump(_Payload(marker), f)
    with pytest.raises(CorruptCheckpoint) as info:
        _check_shard_shapes(folder, {"0.weight": torch.zeros(8, 4)})
    _one_line(info.value, str(folder), ".metadata", "posix.system")
    assert not marker.exists()
    del model


@pytest.mark.parametrize(
    ("value", "needle"),
    [("pickle", "not plain data"), ("fast", "must be a finite number"), (1e-3, "")],
)
def test_dcp_byte_items_load_as_plain_data_of_their_kind(
    value: Any, needle: str, tmp_path: Path
) -> None:
    folder, model, opt = _dcp_folder(tmp_path)
    marker = tmp_path / "marker"
    _point_item(
        folder, "optimizer.param_groups.0.lr", _Payload(marker) if value == "pickle" else value
    )
    if not needle:  # a well-formed value loads: the checks refuse only what is wrong
        loaded = _safe_load(folder, model, opt)
        assert loaded["param_groups"][0]["lr"] == pytest.approx(1e-3)
        return
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException wraps the refusal
        _safe_load(folder, model, opt)
    assert needle in repr(info.value) + repr(getattr(info.value, "failures", ""))
    assert not marker.exists()


def test_dcp_item_bombs_and_paths_outside_the_folder_are_refused(tmp_path: Path) -> None:
    from evendp._training._safe_read import read_dcp_metadata

    folder, model, opt = _dcp_folder(tmp_path)
    with (folder / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    key = next(iter(metadata.storage_data))
    metadata.storage_data[key] = dataclasses.replace(
        metadata.storage_data[key], relative_path="../../etc/passwd"
    )
    with (folder / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(Refused, match="outside its folder"):
        read_dcp_metadata(folder / ".metadata")
    folder, model, opt = _dcp_folder(tmp_path / "b")
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", pickle.dumps(0.5))
    with (folder / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    key = next(k for k in metadata.storage_data if k.fqn == "optimizer.param_groups.0.lr")
    item = folder / metadata.storage_data[key].relative_path
    offset = item.stat().st_size
    item.open("ab").write(bomb.getvalue())
    metadata.storage_data[key] = dataclasses.replace(
        metadata.storage_data[key], offset=offset, length=len(bomb.getvalue())
    )
    with (folder / ".metadata").open("wb") as f:
        pickle.dump(metadata, f)
    with pytest.raises(BaseException) as info:
        _safe_load(folder, model, opt)
    assert "compressed" in repr(info.value) + repr(getattr(info.value, "failures", ""))


def test_checkpoint_files_and_folders_are_private_whatever_the_umask(tmp_path: Path) -> None:
    model, opt = _setup()
    old = os.umask(0)
    try:
        path = tmp_path / "new" / "run" / "ckpt.pt"
        save_checkpoint(path, model=model, optimizer=opt, step=1)
        save_rank_rng(path, rank=1, step=1)
    finally:
        os.umask(old)
    assert (path.stat().st_mode & 0o777) == 0o600
    assert (rank_rng_path(path, 1).stat().st_mode & 0o777) == 0o600
    for folder in (path.parent, path.parent.parent):
        assert (folder.stat().st_mode & 0o777) == 0o700, folder


# -- reads that cannot hang or explode (issue 34) ----------------------------------------------


def _status(field: str) -> int:
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line.split()[1] for line in status if line.startswith(field))) << 10


def _reset_peak_rss() -> int:
    """Reset this process's peak resident memory to its current one, which is returned."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("peak RSS is measured through /proc/self/clear_refs (Linux)")
    Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak to the current RSS
    return _status("VmRSS")


def _peak_rss_growth(since: int) -> int:
    """How far this process's resident memory rose above ``since`` (bytes), at its peak."""
    return _status("VmHWM") - since


def _sparse_checkpoint(path: Path, nbytes: int, step: int) -> None:
    """A checkpoint whose fields are whole and whose one tensor claims ``nbytes``: a sparse file
    (``skip_data`` reserves the tensor's bytes without writing them; 8 KiB on disk)."""
    from evendp._training._checkpoint import RngState

    rng = RngState().state_dict()
    payload = {"format": "evendp-checkpoint", "version": 1, "step": step, "extra": {},
               "model": {"w": torch.empty(nbytes // 4)}, "rng": rng}  # fmt: skip
    with torch.serialization.skip_data():
        torch.save(payload, path)


def test_a_sparse_giant_checkpoint_is_never_read_into_memory(tmp_path: Path) -> None:
    """Issue 34: a 2 GiB sparse ckpt.pt (8 KiB on disk) was read whole by the resume's first
    look (RSS 2.33 GB). The first look reads no tensor data; the load refuses the file by its
    size before reading it and the resume falls back to the previous checkpoint."""
    from evendp._training._checkpointer import Checkpointer, WholeFile

    model, opt = _setup()
    path = tmp_path / "ckpt.pt"
    save_checkpoint(path, model=model, optimizer=opt, step=3)
    save_checkpoint(path, model=model, optimizer=opt, step=4)  # step 3 is now ckpt.prev.pt
    _sparse_checkpoint(path, 2 << 30, step=4)
    assert path.stat().st_size > 2 << 30 and path.stat().st_blocks * 512 < 1 << 20
    rss = _reset_peak_rss()
    found, step, _ = resumable_checkpoint(path)  # type: ignore[misc]
    assert (found, step) == (path, 4)  # its position reads without its tensors
    with pytest.raises(CorruptCheckpoint) as info:
        load_checkpoint(path, model=model, optimizer=opt)
    _one_line(info.value, str(path), "bytes, more than the")
    notes = Checkpointer(WholeFile()).resume(path, {"model": model, "optimizer": opt})
    assert notes is not None and "fell back" in notes[0] and "at step 3" in notes[1], notes
    assert _peak_rss_growth(rss) < 100 << 20  # far from the 2 GiB the file claims


def test_a_giant_rank_rng_file_is_refused_by_its_size(tmp_path: Path) -> None:
    """Issue 34: a rank loaded a 2.4 GB RNG file (a 30 GiB one took the host down)."""
    target = rank_rng_path(tmp_path / "ckpt.pt", 1)
    _sparse_checkpoint(target, 1 << 30, step=2)
    rss = _reset_peak_rss()
    with pytest.raises(CorruptCheckpoint) as info:
        read_rng(target)
    _one_line(info.value, str(target), "bytes, more than the")
    assert _peak_rss_growth(rss) < 100 << 20


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["checkpoint", "rng", "metadata", "state"])
def test_a_fifo_in_place_of_a_checkpoint_file_is_refused_at_once(kind: str, tmp_path: Path) -> None:
    """Issue 34: a FIFO in place of ckpt.pt, ckpt.rng1.pt, FSDP2's .metadata or state.pt hung
    the run (no writer ever comes). Each is refused without blocking, naming the FIFO."""
    from evendp._training._checkpoint import read_state_file
    from evendp._training._safe_read import read_dcp_metadata

    path = tmp_path / "ckpt.pt"
    target = {
        "checkpoint": path,
        "rng": rank_rng_path(path, 1),
        "metadata": tmp_path / "ckpt.dcp" / ".metadata",
        "state": tmp_path / "ckpt.dcp" / "state.pt",
    }[kind]
    target.parent.mkdir(exist_ok=True)
    os.mkfifo(target)
    read = {
        "checkpoint": lambda: resumable_checkpoint(path),
        "rng": lambda: read_rng(target),
        "metadata": lambda: read_dcp_metadata(target),
        "state": lambda: read_state_file(target.parent),
    }[kind]
    with pytest.raises((CorruptCheckpoint, Refused)) as info:
        read()
    _one_line(info.value, "a FIFO, not a regular file")


def test_a_checkpoint_without_its_generators_falls_back_instead_of_a_key_error(
    tmp_path: Path,
) -> None:
    """Issue 34: a ckpt.pt or rank RNG file without its ``rng`` field ended in ``KeyError:
    'rng'`` (exit 1) and the intact previous checkpoint was never tried."""
    model, opt = _setup()
    path = tmp_path / "ckpt.pt"
    for step in (3, 4):
        save_checkpoint(path, model=model, optimizer=opt, step=step)
        save_rank_rng(path, rank=1, step=step)
    _rewrite(path, lambda p: p.pop("rng"))
    _rewrite(rank_rng_path(path, 1), lambda p: p.pop("rng"))
    with pytest.raises(CorruptCheckpoint) as info:
        load_checkpoint(path, model=model, optimizer=opt)
    _one_line(info.value, str(path), "field rng: missing")
    found, step, _ = resumable_checkpoint(path)  # type: ignore[misc]
    assert (found, step) == (previous_path(path), 3)
    with warnings.catch_warnings(record=True):  # the previous step's state: not this one's
        assert load_rank_rng(path, rank=1, step=3) is True  # ckpt.prev.rng1.pt, intact


def test_a_deepspeed_runs_corrupt_position_falls_back_to_its_previous_copy(
    tmp_path: Path,
) -> None:
    """Issue 34: a corrupt ckpt.ds/state.pt beside an intact state.prev.pt stopped the resume's
    first look naming a ckpt.prev.ds that does not exist; it takes state.prev.pt."""
    from evendp._training._checkpointer import WholeFile
    from evendp._training._recorder import TrainState

    ckpt = tmp_path / "ckpt.ds"
    ckpt.mkdir()
    for step in (2, 4):
        WholeFile().save(ckpt / "state.pt", {"train": TrainState(devices=1, step=step)}, rank=0,
                         extra={"global_batch": 4}, keep_previous=True)  # fmt: skip
    (ckpt / "state.pt").write_bytes(b"garbled")
    found, step, extra = resumable_checkpoint(ckpt)  # type: ignore[misc]
    assert (found, step, extra["global_batch"]) == (ckpt / "state.prev.pt", 2, 4)
    (ckpt / "state.prev.pt").write_bytes(b"garbled too")
    with pytest.raises(CorruptCheckpoint) as info:
        resumable_checkpoint(ckpt)
    message = _one_line(info.value, "state.pt", "state.prev.pt", "neither can be resumed")
    assert "ckpt.prev.ds" not in message
