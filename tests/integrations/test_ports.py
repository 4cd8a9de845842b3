"""The ports in examples/: each runs through ``evendp launch`` and equals one process.

One launch (conftest.py's, shared with test_lightning.py: 2 gloo ranks, sizes [1, 3], 17
samples, so the short last step leaves rank 0 nothing) runs the ports
(tests/integrations/_ports_script.py); the one-process
references run here, in the test process, with ``EVENDP_BATCH_SIZES=4`` (the same global
batches). The changed-line counts quoted in docs/integrations.md are measured here too.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._helpers import require
from tests.integrations import _ports_script as script

require("transformers", "lightning")

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
#: port -> the file name its parameters are saved under, and how to get the initial ones
SAVED = {
    "hf_trainer": "hf",
    "accelerate_loop": "accelerate",
    "lightning_module": "lightning",
    "nanogpt_loop": "nanogpt",
    "imagenet_loop": "imagenet",
}
NO_STEPS = {  # the arguments that train nothing: the initial parameters
    "accelerate_loop": ["--epochs", "0"],
    "lightning_module": ["--epochs", "0"],
    "nanogpt_loop": ["--iters", "0"],
    "imagenet_loop": ["--epochs", "0", "--batch-sizes", "4"],
}
#: what the one-process reference adds: the launch's sizes would not fit one process
REFERENCE = {"imagenet_loop": ["--batch-sizes", "4"]}


def _one_process(port: str, out: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> dict:
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "4")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(var, raising=False)
    script.run(port, out, kw.get("extra"))
    return torch.load(out / f"{SAVED[port]}0.pt")


def _start(port: str, out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    if port == "hf_trainer":
        import runpy

        model = runpy.run_path(str(script.EXAMPLES / "hf_trainer.py"), run_name="x")["make_model"]
        return model().state_dict()
    return _one_process(port, out, monkeypatch, extra=NO_STEPS[port])


@pytest.mark.multiprocess
@pytest.mark.parametrize("port", list(SAVED))
def test_each_port_on_two_ranks_equals_one_process(
    launched: Path, port: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "start").mkdir()
    start = _start(port, tmp_path / "start", monkeypatch)
    want = _one_process(port, tmp_path, monkeypatch, extra=REFERENCE.get(port))
    for rank in (0, 1):
        got = torch.load(launched / f"{SAVED[port]}{rank}.pt")
        keys = [k for k in want if want[k].is_floating_point()]  # not the causal mask
        num = sum(float((got[k] - want[k]).norm() ** 2) for k in keys) ** 0.5
        den = sum(float((want[k] - start[k]).norm() ** 2) for k in keys) ** 0.5
        assert den > 0 and num / den < TOL


def changed_lines(port: str) -> tuple[int, int]:
    """(added, removed) non-blank lines of examples/PORT.py against examples/plain/PORT.py,
    the module docstrings left out."""

    def code(path: Path) -> list[str]:
        text = path.read_text()
        body = text[text.index('"""', 3) + 3 :]  # after the module docstring
        return [line for line in body.splitlines() if line.strip()]

    diff = difflib.ndiff(
        code(ROOT / "examples/plain" / f"{port}.py"), code(ROOT / f"examples/{port}.py")
    )
    lines = [d[0] for d in diff]
    return lines.count("+"), lines.count("-")


@pytest.mark.parametrize("port", list(SAVED))
def test_the_docs_quote_the_measured_changed_lines(port: str) -> None:
    added, removed = changed_lines(port)
    docs = (ROOT / "docs/integrations.md").read_text()
    quoted = re.search(rf"`examples/{port}\.py`[^\n]*?\+(\d+)/-(\d+)", docs)
    assert quoted is not None, f"docs/integrations.md quotes no +N/-M for examples/{port}.py"
    assert (int(quoted[1]), int(quoted[2])) == (added, removed)
