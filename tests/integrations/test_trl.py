"""Any Trainer subclass composed with ``UnevenTrainer`` (issue 25): TRL's ``SFTTrainer`` (padded
and packed) and ``DPOTrainer``, ``Seq2SeqTrainer``, and TRL's own ``sft.py`` ported.

One launch (2 gloo ranks, sizes [1, 3], both ranks on one core) trains each composition for two
epochs of 9 samples, whose short last step leaves rank 0 empty, then runs the ported script,
which ends with ``trainer.end()`` (the group destroyed under evendp's feet: the run must still
exit 0). The one-process references run here with ``EVENDP_BATCH_SIZES=4``: the same global
batches. Refused compositions need no launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._helpers import require
from tests.integrations import _trl_script as script
from tests.integrations.test_ports import changed_lines

require("trl")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
HANG_S = 240


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return script.make_assets(tmp_path_factory.mktemp("trl_assets"))


def _env(**extra: str) -> dict[str, str]:
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return {**os.environ, "PYTHONPATH": path, **offline, **extra}


def launch(assets: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """``evendp launch --nproc 2 --batch-sizes 1,3 _trl_script.py`` with both ranks on one core
    (where the ends of runs race gloo's threads for the GIL)."""
    command = [sys.executable, "-m", "evendp", "launch", "--nproc", "2", "--batch-sizes", "1,3"]
    command += [str(Path(script.__file__)), str(assets), str(out), str(HANG_S), *extra]
    return subprocess.run(
        command, env=_env(), capture_output=True, text=True, timeout=HANG_S + 120,
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
    )  # fmt: skip


@pytest.fixture(scope="module")
def launched(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trl_launched")
    done = launch(assets, out)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


@pytest.fixture
def one_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "4")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)


def _relative_error(got: dict[str, Any], want: dict[str, Any], start: dict[str, Any]) -> float:
    num = sum(float((got[k] - want[k]).norm() ** 2) for k in want) ** 0.5
    den = sum(float((want[k] - start[k]).norm() ** 2) for k in want) ** 0.5
    assert den > 0  # it trained
    return num / den


def _start(case: str, assets: Path) -> dict[str, torch.Tensor]:
    if case == "s2s":
        return script.t5_start()
    model, _ = script._load(assets)
    return script._params(model)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(script.CASES))
def test_each_composition_on_two_ranks_equals_one_process(
    launched: Path, assets: Path, tmp_path: Path, one_process: None, case: str
) -> None:
    want = script.CASES[case](assets, tmp_path)
    start = _start(case, assets)
    for rank in (0, 1):
        got = torch.load(launched / f"{case}{rank}.pt")
        assert _relative_error(got, want, start) < TOL
    if case == "s2s":  # predict_with_generate: one process's rows, loss and generations
        one = torch.load(tmp_path / "predictions.pt")
        for rank in (0, 1):
            ranks = torch.load(launched / f"s2s{rank}" / "predictions.pt")
            assert float(ranks["loss"]) == pytest.approx(float(one["loss"]), rel=1e-5)
            # Past a row's end: its batch's padding, pad ids (0) or -100 by which batch
            # the row was in (the collator's, Seq2SeqTrainer's, the gather's).
            for key in ("labels", "generated"):
                got, want = (t.masked_fill(t == -100, 0) for t in (ranks[key], one[key]))
                assert torch.equal(got, want), (key, got, want)


@pytest.mark.multiprocess
def test_the_ported_trl_script_equals_one_process_and_exits_0(
    launched: Path, assets: Path, tmp_path: Path, one_process: None
) -> None:
    from safetensors.torch import load_file

    script.run_port(assets, tmp_path)
    want = load_file(tmp_path / "port" / "model.safetensors")
    start = load_file(assets / "model" / "model.safetensors")
    keys = [k for k in want if want[k].is_floating_point()]
    got = load_file(launched / "port0" / "port" / "model.safetensors")  # rank 0 saves it
    assert _relative_error(got, {k: want[k] for k in keys}, start) < TOL


def test_the_docs_quote_the_ports_measured_changed_lines() -> None:
    import re

    added, removed = changed_lines("trl_sft")
    docs = (ROOT / "docs/integrations.md").read_text()
    quoted = re.search(r"`examples/trl_sft\.py`[^\n]*?\+(\d+)/-(\d+)", docs)
    assert quoted is not None and (int(quoted[1]), int(quoted[2])) == (added, removed)


@pytest.mark.parametrize(
    ("bases", "body", "message"),
    [
        ("sft_first", {}, r"puts SFTTrainer before UnevenTrainer.*\(UnevenTrainer, SFTTrainer\)"),
        ("own_loader", {}, "_OwnLoader overrides get_train_dataloader, which UnevenTrainer"),
        ("own_step", {"training_step": lambda self, *a, **k: 0}, r"does not call super\(\)"),
    ],
)
def test_a_subclass_overriding_what_evendp_relies_on_is_refused(
    bases: str, body: dict[str, Any], message: str
) -> None:
    from trl import SFTTrainer

    import evendp
    from evendp.integrations.transformers import UnevenTrainer

    class _OwnLoader(transformers.Trainer):
        def get_train_dataloader(self) -> Any:
            return super().get_train_dataloader()

    order = {
        "sft_first": (SFTTrainer, UnevenTrainer),
        "own_loader": (UnevenTrainer, _OwnLoader),
        "own_step": (UnevenTrainer,),
    }[bases]
    with pytest.raises(evendp.EvendpError, match=message):  # where the class is written
        type("Composed", order, body)
