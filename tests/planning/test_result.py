"""How a plan reads (issue 27): the table's title on whole lines at any width, the gradient
row labelled for what it is, and the chart's sample counts clear of the budget lines."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import evendp


@pytest.fixture(scope="module")
def plan() -> Any:
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
    # Two devices: a narrow table, where the old title wrapped into a ragged column.
    return evendp.plan(model, lambda n: torch.randn(n, 32), memory="64MiB,32MiB", cuda_context=0)


def test_title_and_caption_lines_are_never_wrapped(plan: Any) -> None:
    text = str(plan.table())
    rendered = {line.strip() for line in text.splitlines()}
    title = plan.table().title
    assert "\n" in title  # two short lines rather than one long one
    for line in [*title.splitlines(), *plan.table().caption.splitlines()]:
        assert line in rendered, (line, text)


def test_the_gradient_row_says_it_is_the_gradients_live_at_the_peak(plan: Any) -> None:
    rows = [line.split("│")[1].strip() for line in str(plan.table()).splitlines() if "│" in line]
    assert "grads at peak" in rows and "grads" not in rows
    assert "grads at peak: the gradients that exist then" in plan.table().caption
    assert "eta_mem: the batch over the sum of what each device holds alone" in plan.table().caption
    # JSON keeps its key (a stable surface).
    assert "grads" in plan.to_dict()["devices"][0]["breakdown"]


def test_the_json_breakdown_keys_follow_the_tables_row_order(plan: Any) -> None:
    # The planner adds the kinds as its phases meet them; the JSON used to follow that
    # order, so two runs of `evendp plan --json` printed the same figures differently.
    from evendp._planning._result import KINDS

    for device in plan.to_dict()["devices"]:
        for key in ("breakdown", "even_breakdown"):
            kinds = list(device[key])
            assert kinds == sorted(kinds, key=KINDS.index), (key, kinds)


def test_sample_counts_in_the_chart_clear_the_budget_lines(plan: Any) -> None:
    fig = plan._figure()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    ax = fig.axes[0]
    budgets = [c for c in ax.collections if c.get_linestyle()[0][1] is not None]
    lines = [seg for c in budgets for seg in c.get_segments()]
    assert len(lines) == len(plan.devices)
    labels = [t for t in ax.texts if t.get_text().isdigit()]
    assert len(labels) == 2 * len(plan.devices)
    for text in labels:
        box = text.get_window_extent(renderer)
        for seg in lines:
            (x0, y), (x1, _) = ax.transData.transform(seg)
            crosses = box.x1 > x0 and box.x0 < x1 and box.y0 < y < box.y1
            assert not crosses, (text.get_text(), box, y)
