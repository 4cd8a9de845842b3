"""Shared fixtures: every test leaves process groups and device environment as it found them."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from tests._extensions import EXTENSIONS_DIR
from tests._pool import close_pool

# DeepSpeed compiles its CPU comm op into a folder of the suite's own (built ahead by make test),
# inherited by every rank and launch the tests start.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(EXTENSIONS_DIR))
# A machine of several that refuses its command waits up to 60 s to tell the others: the
# suite's refusals wait 3 s (tests/cli/test_train_nodes.py gives its pairs the real wait).
os.environ.setdefault("EVENDP_TELL_WAIT_S", "3")


def _hypothesis_profiles() -> None:
    """Shared 2-core machines make wall-clock deadlines flaky; correctness is what is tested.
    "dev" explores new examples on every run; CI (CI=true) replays a fixed seed so a landing
    is decided by the code, not by the draw; "thorough" (HYPOTHESIS_PROFILE=thorough) searches
    hard. Hypothesis is a dev extra: without it (a bare GPU machine) its tests skip."""
    if importlib.util.find_spec("hypothesis") is None:
        return
    from hypothesis import HealthCheck, settings

    common = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
    settings.register_profile("dev", **common)
    settings.register_profile("ci", derandomize=True, **common)
    settings.register_profile("thorough", max_examples=400, **common)
    settings.load_profile(
        os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    )


_hypothesis_profiles()

# Variables evendp or torchrun may set; restored after every test.
_ENV_KEYS = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "EVENDP_BATCH_SIZES",
    "EVENDP_BATCH_DEFAULTED",
    "PYTORCH_CUDA_ALLOC_CONF",  # evendp's CLI chooses the allocator setting when unset
)


@pytest.fixture(autouse=True)
def clean_process_state() -> Iterator[None]:
    """Destroy any process group a test made and restore the device environment variables."""
    saved = {key: os.environ.get(key) for key in _ENV_KEYS}
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session", autouse=True)
def rank_pool() -> Iterator[None]:
    """The shared rank pool (tests._pool) is stopped at the end of the run, so its ranks exit
    normally (and save their coverage data)."""
    yield
    close_pool()
