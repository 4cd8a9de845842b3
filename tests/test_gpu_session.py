"""benchmarks/gpu_session.sh: its dry run (the CPU-capable steps, on the CPU) passes and
writes a summary.json with every step; bad arguments exit 2. The GPU steps run on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
GPU_ONLY = {"gpu-tests", "weights-auto", "oom-resplit", "nvml-vs-cuda", "nccl-one-rank",
            "overhead"}  # fmt: skip
# Steps whose dry run imports their script, then skips (mixed-box runs its --smoke).
SCRIPTS = {
    "capped-batch",
    "step-costs",
    "planner-allocator",
    "planner-allocator-expandable",
}


def _session(*argv: str, out: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PY": sys.executable, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        ["bash", str(SCRIPT), *argv, "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


@pytest.mark.multiprocess
def test_dry_run_passes_and_writes_the_summary(tmp_path: Path) -> None:
    proc = _session("--dry-run", out=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    steps = summary["steps"]
    assert summary["dry_run"] is True and summary["passed"] is True
    listed = subprocess.run(
        [sys.executable, str(SCRIPT.with_name("gpu_checks.py")), "list"],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout.split()  # fmt: skip
    assert sorted(steps) == sorted(listed) and len(listed) >= 18  # every step ran or skipped
    for name, step in steps.items():
        expected = "skip" if name in GPU_ONLY | SCRIPTS else "pass"
        assert step["status"] == expected, (name, step)
        if name in SCRIPTS:
            assert step["note"] == "GPU only (the script imports)", (name, step)
        assert (tmp_path / step["log"]).exists()
    # Figures are measured, not constants: the exactness steps report their errors.
    assert 0 <= steps["exact-repeated"]["figures"]["pageable_rel_err"] <= 1e-5
    assert 0 <= steps["demo"]["figures"]["exactness"] <= 1e-5
    # mixed_box.py --smoke as documented (no --memory): CPU-sized memory, the plan trains.
    box = steps["mixed-box"]["figures"]
    assert box["memory"] == "24MiB,12MiB" and box["planned_ran"] is True
    assert 0 < box["planned_global"] <= box["best_global"]
    assert steps["env"]["figures"]["evendp_from"] == str(ROOT / "src" / "evendp")


def test_only_and_bad_arguments(tmp_path: Path) -> None:
    proc = _session("--only", "nonsense", out=tmp_path)
    assert proc.returncode == 2 and "unknown step 'nonsense'" in proc.stderr
    proc = _session("--bogus", out=tmp_path)
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
