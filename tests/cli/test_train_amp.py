"""With --amp the demo's even-split probe runs in the precision that trains, so its verdict and
the picture agree with the run (bf16 activations are half fp32's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from evendp.cli import main


def test_bf16_even_split_probe_agrees_with_the_bf16_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The demo's budgets: in fp32 an even split of 32 overflows the 24 MiB device; in bf16 the
    # planner's split is the even one, and the probe must find that it fits.
    code = main(["train", "--amp", "bf16", "--steps", "1", "--no-progress", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "report.json").read_text())
    devices = report["devices"]
    ours = [d["samples_per_step"] for d in devices]
    assert ours == [d["even_samples"] for d in devices]  # bf16: the planner's split is even
    assert "fits these budgets too" in out and "fails" not in out
    assert not any(d["even_oom"] for d in devices)
    for d in devices:  # the same shares in the same precision: the same forward peak
        assert d["even_forward_peak_bytes"] == pytest.approx(d["peak_bytes"], rel=0.1)
    assert "bf16 autocast" in " ".join(
        out.split()
    )  # the report's title (and the PNG's) says the precision
