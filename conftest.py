"""Repository-level pytest configuration: files that must not be imported for doctests,
doctests of public objects collected where they are defined, and a suite that leaves nothing
in the temporary folder."""

from __future__ import annotations

import doctest
import importlib.util
import inspect
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests._gc import freeze_survivors
from tests._optional import skip_when_an_extra_is_missing, unread_markdown

collect_ignore = ["src/evendp/__main__.py"]
# tests/test_suite_tiers.py runs a hung test in a pytest of its own.
pytest_plugins = ["pytester"]
_INTEGRATIONS = "src/evendp/integrations"

# Every code block of README.md and docs/*.md runs (or is checked) as a test: tests/_markdown.py,
# through Sybil. Collecting imports nothing optional (tests/_optional.py): without Sybil, a dev
# extra, each Markdown file is one skipped item; a module importing a missing extra skips.
if importlib.util.find_spec("sybil") is not None:
    from tests._markdown import markdown_sybil

    pytest_collect_file = markdown_sybil.pytest()
else:
    pytest_collect_file = unread_markdown


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[pytest.CollectReport]:
    """A module that imports a dev extra not installed here is skipped, not an error."""
    skip_when_an_extra_is_missing(collector)
    return (yield)


def _defining_module(obj: Any) -> str | None:
    """The module that defines a public evendp object (which reports ``__module__ ==
    "evendp"``): its functions' globals say where it was written. ``None`` for others."""
    if getattr(obj, "__module__", None) != "evendp":
        return None
    if inspect.isfunction(obj):
        return obj.__globals__.get("__name__")  # type: ignore[no-any-return]
    if inspect.isclass(obj):
        for member in vars(obj).values():
            if inspect.isfunction(member):
                return member.__globals__.get("__name__")  # type: ignore[no-any-return]
    return None


_from_module = doctest.DocTestFinder._from_module  # type: ignore[attr-defined]


def _from_defining_module(self: Any, module: Any, obj: Any) -> bool:
    # evendp/__init__.py sets __module__ = "evendp" on every public object, so tracebacks
    # show evendp.EvendpError. Doctest would then collect a class's docstring under
    # evendp/__init__.py (with the wrong globals) and its methods nowhere; keep collecting
    # each object in the module that defines it, as before the rename.
    home = _defining_module(obj)
    if home is not None:
        return module is not None and module.__name__ == home
    return bool(_from_module(self, module, obj))


doctest.DocTestFinder._from_module = _from_defining_module  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def _deepspeed_imported_before_integration_doctests(request: Any) -> Iterator[None]:
    # Accelerate imports DeepSpeed, when installed, inside the Trainer's constructor; on its
    # first import DeepSpeed logs "Setting accelerator to CPU" to the stdout of that moment,
    # which a doctest would read as its example's output (only when it runs first). Importing
    # it here, outside any example, makes the integrations' doctests independent of order.
    node = request.node
    integration = isinstance(node, pytest.DoctestItem) and _INTEGRATIONS in node.path.as_posix()
    if integration and importlib.util.find_spec("deepspeed") is not None:
        import deepspeed  # noqa: F401
    yield


@pytest.fixture(autouse=True)
def _doctest_temp_folder(request: Any) -> Iterator[None]:
    # The docstrings' examples make folders as a reader would (tempfile.mkdtemp()); under the
    # suite each example makes them in a folder of its own, removed after it.
    if not isinstance(request.node, pytest.DoctestItem):
        yield
        return
    with tempfile.TemporaryDirectory(prefix="evendp-doctest-") as folder:
        before, tempfile.tempdir = tempfile.tempdir, folder
        try:
            yield
        finally:
            tempfile.tempdir = before


# --- the temporary folder: the suite leaves nothing in it -------------------------------------
# The run (its xdist workers, every rank and command it starts) gets a temporary folder of its
# own (TMPDIR), removed at the end: whatever a test, a rank or a library leaves there goes with
# it, and only this run writes there, so what is left is this run's, with or without workers.
# A folder of evendp's left in it (``evendp-*``) is a leak to fix at its source: the run fails,
# naming it. Others are listed (a library's), except torch's own: torchrun's per-launch log
# folders and inductor's cache.
_SUITE_TMP: list[tuple[Path, str | None]] = []
_TORCH_FOLDERS = ("torchelastic_", "torchinductor_")


@pytest.hookimpl(trylast=True)  # after pytest's own temp-path factory is configured
def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a worker writes in its controller's folder (inherited TMPDIR)
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is not None:
        factory.getbasetemp()  # pytest's tmp_path stays where pytest keeps it (and xdist's)
    root = Path(tempfile.mkdtemp(prefix="evendp-suite-"))
    root.chmod(0o755)  # as /tmp is to the tests that run a command as another user
    _SUITE_TMP.append((root, os.environ.get("TMPDIR")))
    os.environ["TMPDIR"] = str(root)
    tempfile.tempdir = None  # read again from TMPDIR


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _SUITE_TMP:
        return
    root, before = _SUITE_TMP.pop()
    private = f"evendp-{os.geteuid()}"  # evendp's own per-user folder: kept by design
    left = sorted(p.name for p in root.iterdir() if p.name != private)
    shutil.rmtree(root, ignore_errors=True)
    if before is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = before
    tempfile.tempdir = None
    ours = [name for name in left if name.startswith("evendp-")]
    others = [name for name in left if name not in ours and not name.startswith(_TORCH_FOLDERS)]
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None and (ours or others):
        reporter.line("")  # after the progress line
    if others and reporter is not None:
        reporter.write_line(f"left in the temporary folder (removed): {', '.join(others)}")
    if ours:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter is not None:
            reporter.write_line(
                f"FAILED: the suite left {len(ours)} evendp folder(s) in the temporary folder: "
                f"{', '.join(ours[:10])}; remove each where it is made (tmp_path, "
                "TemporaryDirectory)",
                red=True,
            )


# --- scheduling under pytest-xdist (make test runs `-n 2 --dist loadfile`: a module's tests on
# one worker, so its module-scoped launch or pool task runs once) -----------------------------
# The modules that run longest (launches, pool tasks), longest first: handed out first, they
# do not end the run alone on one worker. The order only balances the two workers; a module
# missing here runs later, never wrongly.
SLOW_FIRST = (
    "tests/cli/test_train_faults.py",
    "tests/integrations/test_deepspeed.py",
    "tests/cli/test_train_nodes.py",
    "tests/cli/test_train.py",
    "tests/integrations/test_trl.py",
    "tests/training/test_strategy_deepspeed.py",
    "tests/integrations/test_lightning.py",
    "tests/integrations/test_ports.py",
    "tests/planning/test_memory.py",
    "tests/training/test_faults.py",
    "tests/integrations/test_transformers.py",
    "tests/planning/test_launch.py",
    "tests/cli/test_train_options.py",
    "tests/test_gpu_session.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow modules first."""

    def rank(item: pytest.Item) -> int:
        module = item.nodeid.split("::", 1)[0]
        return SLOW_FIRST.index(module) if module in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: the order within a module is kept


# --- the garbage collector: tests/_gc.py ---------------------------------------------------
def pytest_collection_finish(session: pytest.Session) -> None:
    """What collection imported lives to the end: out of every later collection."""
    freeze_survivors()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """At the end of a module, once its fixtures are gone, what its tests imported (a
    library, a model class) likewise."""
    yield
    if nextitem is None or nextitem.path != item.path:
        freeze_survivors()
