"""The launch shared by test_lightning.py and test_ports.py: one torchrun start, not two (one per
pytest run, even when the two modules run on different xdist workers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._once import once_per_run

ROOT = Path(__file__).resolve().parents[2]

#: A rank still running after this long is hung: it prints every thread's stack and exits 1
#: (the whole launch takes about 16 s with both ranks on one core).
HANG_S = 150


@pytest.fixture(scope="session")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT_DIR of ``evendp launch --nproc 2 --batch-sizes 1,3 _launched.py OUT_DIR``."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    with once_per_run(tmp_path_factory, "launched") as (out, done):
        if not done:
            _launch(out)
    return out


def _launch(out: Path) -> None:
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "evendp", "launch", "--nproc", "2", "--batch-sizes", "1,3"]
    command += [str(ROOT / "tests/integrations/_launched.py"), str(out), str(HANG_S)]
    # Both ranks on one core: the ends of the frameworks' runs (Accelerate's end_training,
    # gloo's teardown) race their worker threads for the GIL, which a shared core makes
    # likely; a rank that hangs dumps its stacks and exits (_launched.py's faulthandler).
    done = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=HANG_S + 120, preexec_fn=_one_core
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def _one_core() -> None:
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
