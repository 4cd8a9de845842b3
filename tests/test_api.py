"""The public surface: a curated __all__, docstrings, private modules, no import side effects."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import evendp

EXPECTED_ALL = {
    "BalancedDataParallel",
    "CSVLogger",
    "Callback",
    "MLflowLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "rehearse",
    "DeviceInfo",
    "DeviceMemory",
    "DevicePlan",
    "EmptySafeCollate",
    "EngineMean",
    "CheckpointError",
    "EvendpError",
    "InputError",
    "LiveMemoryError",
    "NvmlUnavailableError",
    "OomResplit",
    "ParallelCriterion",
    "Plan",
    "PlanError",
    "Predictions",
    "Scattered",
    "SpeedBalancer",
    "StepMean",
    "StepLayout",
    "config_micro_batch",
    "label_shift",
    "layout_step",
    "planned_rank_sizes",
    "settle_group",
    "TrainConfig",
    "TrainReport",
    "TrainingError",
    "Trainer",
    "UnevenBatchSampler",
    "balance_sizes",
    "batch_sizes_from_env",
    "count_tokens",
    "ddp_loss",
    "finish_distributed",
    "gather",
    "global_count",
    "global_mean",
    "init_distributed",
    "is_stand_in",
    "share_loss",
    "list_devices",
    "live_memory",
    "load_checkpoint",
    "parse_batch_sizes",
    "padded_cost",
    "parse_memory",
    "plan",
    "predict",
    "save_checkpoint",
    "select_devices",
    "split_by_cost",
    "split_sizes",
}


def test_all_is_the_curated_list() -> None:
    assert set(evendp.__all__) == EXPECTED_ALL
    assert len(evendp.__all__) == len(set(evendp.__all__))


def test_every_public_name_exists_and_is_documented() -> None:
    for name in evendp.__all__:
        obj = getattr(evendp, name)
        assert obj.__doc__ and obj.__doc__.strip(), name
        # @dataclass fills a missing docstring with the signature: that is not documentation.
        assert not obj.__doc__.startswith(f"{name}("), name


def test_implementation_modules_are_private() -> None:
    public = {m.name for m in pkgutil.iter_modules(evendp.__path__) if not m.name.startswith("_")}
    # Only the command line, the built-in examples and the integrations are public packages.
    assert public <= {"cli", "examples", "integrations"}


def test_py_typed_ships() -> None:
    from importlib.resources import files

    assert files("evendp").joinpath("py.typed").is_file()


def test_import_has_no_side_effects() -> None:
    code = (
        "import os, sys; before = dict(os.environ); import evendp, torch; "
        "assert dict(os.environ) == before, 'environment changed'; "
        "assert not torch.cuda.is_initialized(), 'CUDA initialized'; "
        "assert 'torch.distributed.run' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_public_objects_report_the_package_as_their_module() -> None:
    for name in evendp.__all__:
        obj = getattr(evendp, name)
        if isinstance(obj, type) or callable(obj):
            assert obj.__module__ == "evendp", name


def test_errors_show_their_public_name() -> None:
    import traceback

    try:
        evendp.parse_memory("24 furlongs")
    except evendp.EvendpError as exc:
        shown = "".join(traceback.format_exception_only(type(exc), exc))
    assert shown.startswith("evendp.InputError: cannot read device entry")
    assert repr(evendp.PlanError) == "<class 'evendp.PlanError'>"
