"""Collecting the suite imports nothing optional (tests/_optional.py): ``pytest -m gpu`` on a
machine without the dev extras collects the GPU tests. Checked in a pytest of its own whose
imports cannot see any dev extra, on a sample of what collection meets: both conftests, a
module that imports Hypothesis, an integration collected for its doctests, a helper that
imports Sybil, README.md, and the GPU tests. (The whole suite was collected so in a venv of
torch, evendp and pytest alone: ``pytest -m gpu --collect-only``.)"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._optional import DEV_EXTRAS, missing_extra

ROOT = Path(__file__).resolve().parent.parent

# Runs pytest with every finder of imports blind to the hidden packages, as if not installed:
# importing one fails and importlib.util.find_spec answers None.
HIDDEN_PYTEST = """
import sys

hidden = set(sys.argv[1].split(","))


class Blind:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in hidden or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def invalidate_caches(self):
        getattr(self.finder, "invalidate_caches", lambda: None)()


sys.meta_path[:] = [Blind(finder) for finder in sys.meta_path]
import pytest

sys.exit(pytest.main(sys.argv[2:]))
"""

SAMPLE = [
    "tests/test_gpu_tier.py",
    "tests/core/test_cost.py",  # imports hypothesis
    "src/evendp/integrations/transformers.py",  # collected for its doctests
    "tests/_markdown.py",  # imports sybil
    "README.md",
]


def _collect(hidden: set[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"}
    argv = ["-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider", *SAMPLE]
    return subprocess.run(
        [sys.executable, "-c", HIDDEN_PYTEST, ",".join(sorted(hidden)), *argv],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False,
    )  # fmt: skip


def test_the_gpu_tests_collect_without_any_dev_extra() -> None:
    proc = _collect(set(DEV_EXTRAS))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    collected = [line for line in proc.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith("tests/test_gpu_tier.py::") for line in collected)
    assert "error" not in proc.stdout.splitlines()[-1], out


def test_only_a_dev_extra_that_is_really_absent_skips(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> ModuleNotFoundError:
        return ModuleNotFoundError(f"No module named {name!r}", name=name)

    try:  # as pytest raises it: a collection error caused by the import's
        raise RuntimeError("ImportError while importing test module") from absent("sybil.parsers")
    except RuntimeError as exc:
        chained = exc
    assert missing_extra(absent("evendp_gone")) is None  # not an extra: a real error
    installed = importlib.util.find_spec("hypothesis") is not None
    assert missing_extra(absent("hypothesis")) == (None if installed else "hypothesis")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)  # nothing installed
    assert missing_extra(chained) == "sybil"
