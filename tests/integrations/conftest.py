"""The launch shared by test_lightning.py and test_ports.py: one torchrun start, not two."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def launched(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """OUT_DIR of ``evendp launch --nproc 2 --batch-sizes 1,3 _launched.py OUT_DIR``."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("launched")
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "evendp", "launch", "--nproc", "2", "--batch-sizes", "1,3"]
    command += [str(ROOT / "tests/integrations/_launched.py"), str(out)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out
