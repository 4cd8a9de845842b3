"""One meaning per name: plan's amp spellings match the rest of evendp."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evendp import EvendpError, plan
from evendp._core._amp import amp_dtype

NET = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
MEMORY = "64MiB,64MiB"


def test_plan_takes_the_train_config_amp_spellings() -> None:
    assert amp_dtype("bf16") is torch.bfloat16 and amp_dtype("none") is None
    by_name = plan(NET, torch.randn(1, 16), MEMORY, amp="bf16", cuda_context=0)
    by_dtype = plan(NET, torch.randn(1, 16), MEMORY, amp=torch.bfloat16, cuda_context=0)
    assert by_name.split == by_dtype.split
    with pytest.raises(EvendpError, match="amp must be one of"):
        plan(NET, torch.randn(1, 16), MEMORY, amp="fp8")
