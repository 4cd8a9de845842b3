"""``Trainer(strategy="deepspeed")``: ZeRO 1-3 on 2 gloo ranks equals one process.

One ``evendp launch`` runs every case of tests/training/_deepspeed_strategy_script.py (DeepSpeed
starts once); the one-process references (the same Trainer, the whole step on one CPU device)
run here. The config checks and the safe read of DeepSpeed's files need no launch.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

import evendp
from evendp._core._errors import EvendpError
from tests.training import _deepspeed_strategy_script as script

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
#: A rank still running after this long is hung: it prints every thread's stack and exits 1.
HANG_S = 900


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env.pop("EVENDP_BATCH_SIZES", None)
    return env


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("ds_strategy")
    command = [sys.executable, "-m", "evendp", "launch", "--nproc", "2"]
    command += [str(ROOT / "tests/training/_deepspeed_strategy_script.py"), str(out), str(HANG_S)]
    disk = out / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                             capture_output=True).returncode == 0  # fmt: skip
    try:
        done = subprocess.run(
            command + [str(disk)] * mounted, env=_env(), capture_output=True, text=True,
            timeout=HANG_S + 120,
        )  # fmt: skip
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(disk)], check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def _reference(case: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The case's final and starting parameters, trained in this one process."""
    t = script.trainer(case, strategy=None)
    start = {k: v.detach().clone() for k, v in t.model.named_parameters()}
    t.fit()
    return {k: v.detach().clone() for k, v in t.model.named_parameters()}, start


def _error(got: dict, want: dict, start: dict) -> float:
    """||got - want|| / ||want - start|| over every parameter."""
    assert got.keys() == want.keys()
    num = sum(float((got[k] - want[k]).norm() ** 2) for k in want) ** 0.5
    den = sum(float((want[k] - start[k]).norm() ** 2) for k in want) ** 0.5
    assert den > 0  # the run moved the weights: the comparison means something
    return num / den


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(script.CASES))
def test_zero_stages_on_uneven_ranks_equal_one_process(launched: Path, name: str) -> None:
    """ZeRO-1 on [1, 3] with clipping and the short last step; ZeRO-2 with an empty rank,
    accum=2 and the default AdamW; ZeRO-3 on a tiny GPT-2 with padding, -100 labels and
    counted tokens; ZeRO-3 with momentum."""
    want, start = _reference(script.CASES[name])
    for rank in (0, 1):
        got = torch.load(launched / name / f"rank{rank}.pt")
        assert _error(got, want, start) < TOL, (name, rank)


@pytest.mark.multiprocess
@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(script.HOST_READS))
def test_a_steady_deepspeed_step_reads_the_host_no_more_than_allowed(
    launched: Path, case: str
) -> None:
    from tests.training.test_host_reads import HostRead, _check

    for rank in range(2):
        summary = torch.load(launched / "host_reads" / case / f"rank{rank}.pt")
        windows = {k: [HostRead(*r) for r in reads] for k, reads in summary.items()}
        _check(case, windows, rank=rank)


def test_a_resumed_zero3_run_equals_the_straight_run(launched: Path) -> None:
    """Saved at step 2 (DeepSpeed's files in ckpt.ds), resumed by a new Trainer to step 4."""
    want, start = _reference(script.CASES["z3_straight"])
    notes = (launched / script.RESUMED / "notes.txt").read_text()
    assert "at step 2" in notes
    for rank in (0, 1):
        got = torch.load(launched / script.RESUMED / f"rank{rank}.pt")
        straight = torch.load(launched / "z3_straight" / f"rank{rank}.pt")
        assert _error(got, want, start) < TOL, rank
        assert _error(got, straight, start) < TOL, rank
    ckpt = launched / "resume_run" / "ckpt.ds"
    assert {p.name for p in ckpt.glob("step*")} == {"step2", "step4"}  # the last two kept


def test_every_group_deepspeed_reduces_in_gets_the_comm_timeout(launched: Path) -> None:
    """Issue 34: a stalled rank under DeepSpeed hung the run: DeepSpeed reduces in groups of
    its own, which kept gloo's 30 minutes when only the default group got comm_timeout."""
    import ast

    timeouts = ast.literal_eval((launched / "timeouts.txt").read_text())
    assert len(timeouts) > 1  # the default group and DeepSpeed's
    assert set(timeouts) == {evendp.TrainConfig().comm_timeout}, timeouts


def test_a_full_disk_under_deepspeed_is_one_error_on_every_rank(launched: Path) -> None:
    """Issue 34: a DeepSpeed save on a full disk printed 152 lines and 4 tracebacks. Every rank
    raises the same one-line error naming the file and the cause, after DeepSpeed's own
    collectives ran to their end; the torn step folder is gone and step 1 is intact."""
    import ast

    if not (launched / "full_disk").exists():
        pytest.skip("cannot mount a tmpfs here (needs root): no real full disk to test")
    said = [ast.literal_eval((launched / "full_disk" / f"rank{r}.txt").read_text()) for r in (0, 1)]
    assert said[0] == said[1] and said[0][0] == "TrainingError", said
    message = said[0][1]
    assert "\n" not in message and "No space left on device" in message, message
    assert "ckpt.ds" in message and "resume with --resume" in message, message
    assert "intact (state.pt" in message, message
    kept = ast.literal_eval((launched / "full_disk" / "kept.txt").read_text())
    assert "ckpt.ds/step1" in kept and "ckpt.ds/state.pt" in kept, kept
    assert not any(k.startswith("ckpt.ds/step2") for k in kept), kept


def test_deepspeed_checkpoint_files_are_the_owners_alone(launched: Path) -> None:
    """ckpt.ds and everything in it: no group or other permission bits (DeepSpeed writes with
    the umask's 0644; the other modes' files are 0600)."""
    import ast

    modes = ast.literal_eval((launched / script.RESUMED / "modes.txt").read_text())
    assert any(name.endswith("_states.pt") for name in modes)  # DeepSpeed's files are listed
    assert {name: oct(m) for name, m in modes.items() if m & 0o077} == {}


def test_a_garbled_deepspeed_step_falls_back_to_the_previous_position(launched: Path) -> None:
    """Step 4's partition file garbled: the resume names it, takes state.prev.pt (step 2) and
    its folder, and trains to the straight run's weights; the bad step is not kept over it."""
    want, start = _reference(script.CASES["z3_straight"])
    notes = (launched / script.FELL_BACK / "notes.txt").read_text()
    assert "step4" in notes and "fell back to the previous position" in notes, notes
    assert "at step 2" in notes, notes
    for rank in (0, 1):
        got = torch.load(launched / script.FELL_BACK / f"rank{rank}.pt")
        assert _error(got, want, start) < TOL, rank
    assert (launched / script.FELL_BACK / "kept.txt").read_text() == "step2 step4"


@pytest.mark.multiprocess
def test_evendp_train_mode_deepspeed_runs_and_a_stalled_rank_ends_it(tmp_path: Path) -> None:
    """A run of 3 steps; then its resume with rank 1 stopped (``kill -STOP``) under
    ``--comm-timeout 10`` (issue 34: it hung until killed from outside): every process gone
    within 60 s, exit 1, one line naming rank 1, no traceback, the checkpoint kept."""
    import signal
    import time

    from tests.cli.test_train_faults import _step, _wait_for, _workers

    pytest.importorskip("deepspeed")
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    out = tmp_path / "run"
    command = [sys.executable, "-m", "evendp", "train", "--mode", "deepspeed", "--devices",
               "cpu,cpu", "--strategy-config", str(config), "--batch", "4",
               "--n-layer", "1", "--n-embd", "16", "--block-size", "16", "--max-chars", "10000",
               "--no-progress", "--out", str(out)]  # fmt: skip
    done = subprocess.run(
        [*command, "--steps", "3"], env=_env(), capture_output=True, text=True, timeout=HANG_S
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["mode"] == "deepspeed" and report["steps"] == 3
    state = out / "ckpt.ds" / "state.pt"
    assert state.is_file()
    argv = ["--steps", "2000", "--checkpoint-every", "2", "--comm-timeout", "10", "--resume"]
    proc = subprocess.Popen(
        [*command, *argv], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(lambda: (_step(state) or 0) >= 7, 300, "a DeepSpeed checkpoint at step 7")
        workers = _workers(out)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[1], signal.SIGSTOP)
        sent = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        gone = _wait_for(lambda: not _workers(out) or None, 60, "every rank to exit")
        took = time.monotonic() - sent
    finally:
        for pid in _workers(out).values():
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert proc.returncode == 1 and gone and took < 60, output[-3000:]
    said = [line for line in output.splitlines() if "stopped answering" in line]
    assert len(said) == 1 and said[0].startswith("evendp: error: rank 1 stopped answering")
    assert "Traceback" not in output, output[-3000:]
    assert (_step(state) or 0) >= 7  # the last good checkpoint stays


# -- no launch ---------------------------------------------------------------------------------


def test_the_registry_names_deepspeed_without_importing_it() -> None:
    code = (
        "import sys; from evendp._training._strategies import rank_strategy_names; "
        "import evendp; evendp.TrainConfig(strategy='deepspeed'); "
        "print('deepspeed' in rank_strategy_names(), 'deepspeed' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True)
    assert done.stdout.split() == ["True", "False"], done.stderr[-2000:]


def _config(**settings: Any) -> Any:
    from evendp._training._strategies._deepspeed import deepspeed_config

    return deepspeed_config(evendp.TrainConfig(strategy="deepspeed", **settings), [0, 5])


def test_the_config_is_filled_in_from_the_run(tmp_path: Path) -> None:
    ds = _config(grad_clip=None, amp="bf16")
    assert ds["zero_optimization"] == {"stage": 2}  # the default
    assert (ds["train_micro_batch_size_per_gpu"], ds["train_batch_size"]) == (3, 6)
    assert ds["gradient_accumulation_steps"] == 1 and ds["gradient_clipping"] == 0.0
    assert ds["bf16"] == {"enabled": True} and "fp16" not in ds
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_clipping": 2.0}))
    ds = _config(strategy_config=str(path))
    assert ds["zero_optimization"] == {"stage": 3} and ds["gradient_clipping"] == 2.0


@pytest.mark.parametrize(
    ("given", "amp", "said"),
    [
        ({"train_batch_size": 8}, "none", "sets train_batch_size=8, which evendp sets"),
        ({"gradient_accumulation_steps": 4}, "none", "gradient_accumulation_steps=4"),
        ({"bf16": {"enabled": True}}, "none", "enables bf16, but amp='none'"),
        ({"fp16": {"enabled": False}}, "fp16", "disables fp16, but amp='fp16'"),
        ({"zero_optimization": {"stage": 4}}, "none", "stage must be 0, 1, 2 or 3, got 4"),
        ({"checkpoint": {"load_universal": True}}, "none", "checkpoint.load_universal"),
    ],
)
def test_a_contradicting_config_is_refused_in_one_line(given: dict, amp: str, said: str) -> None:
    with pytest.raises(EvendpError, match="strategy='deepspeed'") as caught:
        _config(strategy_config=given, amp=amp)
    assert said in str(caught.value) and "\n" not in str(caught.value)


def test_a_config_file_that_is_not_a_json_object_is_refused(tmp_path: Path) -> None:
    for text, said in (("{nope", "is not JSON"), ("[1, 2]", "holds a list, not a JSON object")):
        path = tmp_path / "ds.json"
        path.write_text(text)
        with pytest.raises(EvendpError, match=said):
            _config(strategy_config=str(path))


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo pwned",))


def test_deepspeed_files_are_read_as_data_never_code(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    from evendp._training._checkpoint import CorruptCheckpoint
    from evendp._training._strategies._deepspeed import safe_load

    good = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {"w": torch.ones(2)}, "global_steps": 3}, good)
    assert safe_load(good)["global_steps"] == 3
    evil = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _Boom()}, evil)
    with pytest.raises(CorruptCheckpoint, match="not plain data"):
        safe_load(evil)
    bomb = tmp_path / "bomb.pt"
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("a/data.pkl", pickle.dumps({}))
        z.writestr("a/data/0", bytes(1_000_000))
    with pytest.raises(CorruptCheckpoint, match="compressed"):
        safe_load(bomb)
