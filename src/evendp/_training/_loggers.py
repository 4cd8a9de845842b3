"""Metric loggers: Trainer callbacks that write ``on_log`` / ``on_eval`` metrics somewhere, on
rank 0 only; each is also usable alone (``log_metrics(metrics, step)``, then ``close()``).
Training metrics go under ``train/`` (the CSV file keeps them bare), the evaluation's under
``val/``. A logger's package is imported when it is made; a missing one is named with its
``pip install`` line.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import os
import time
from pathlib import Path
from typing import Any

from .._core._errors import EvendpError
from .._core._files import NotReadable, mkdir_private, open_append, open_regular, replace_file
from .._core._validate import validate_instance, validate_path
from ._recorder import Callback

__all__ = ["CSVLogger", "MLflowLogger", "MetricLogger", "TensorBoardLogger", "WandbLogger"]


def _needs(package: str, logger: str, pip: str) -> Any:
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise EvendpError(
            f"{logger} needs the {pip} package, which is not installed; pip install {pip} "
            "(or log with evendp.CSVLogger, which needs nothing)"
        ) from None


def _prefixed(metrics: dict[str, float], kind: str) -> dict[str, float]:
    """``{"loss": 2.0}`` as ``{"train/loss": 2.0}``; names with a ``/`` stay as they are."""
    return {k if "/" in k or not kind else f"{kind}/{k}": float(v) for k, v in metrics.items()}


class MetricLogger(Callback):
    """What every shipped logger shares: the Trainer's hooks mapped to ``log_metrics``."""

    #: What the training metrics' names start with (``train/loss``).
    train_prefix = "train"

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write ``metrics`` (final names) at ``step``."""
        raise NotImplementedError

    def close(self) -> None:
        """Flush and release the file or run (a later ``log_metrics`` opens it again)."""

    def on_log(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if trainer.rank == 0:
            self.log_metrics(_prefixed(metrics, self.train_prefix), step)

    def on_eval(self, trainer: Any, step: int, metrics: dict[str, float]) -> None:
        if trainer.rank == 0:
            self.log_metrics(_prefixed(metrics, "val"), step)

    def on_fit_end(self, trainer: Any, report: Any) -> None:
        if trainer.rank == 0:
            self.close()


#: A resumed run's metrics file read back: a row per step is far below this.
_MAX_CSV_BYTES = 256 << 20


class CSVLogger(MetricLogger):
    """One row per logged step in a CSV file: ``step`` and a column per metric.

    A metric that appears later (a validation loss) adds a column: the file is rewritten with
    the wider header, earlier rows left empty there. Training metrics keep their bare names.
    A file already there (a resumed run's) keeps its rows before the first step written now;
    its rows from that step on (steps the resume trains again) are replaced.

    >>> path = getfixture("tmp_path") / "metrics.csv"
    >>> log = CSVLogger(path)
    >>> log.log_metrics({"loss": 2.5}, step=1)
    >>> log.log_metrics({"loss": 2.0, "val/loss": 2.2}, step=2)
    >>> print(path.read_text().strip())
    step,loss,val/loss
    1,2.5,
    2,2.0,2.2
    """

    train_prefix = ""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(validate_path("path", path))
        self._rows: list[dict[str, Any]] = []
        self._columns: list[str] = ["step"]

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self._rows and self.path.is_file():
            self._keep_earlier(step)
        metrics = {k: int(v) if k.startswith("memory/") else float(v) for k, v in metrics.items()}
        if self._rows and self._rows[-1]["step"] == step:
            self._rows[-1].update(metrics)  # an evaluation at a logged step: the same row
        else:
            self._rows.append({"step": step, **metrics})
        new = [k for k in metrics if k not in self._columns]
        self._columns += new
        # A new column, or a row extended in place: rewrite the file; else append one row.
        self._write(whole=bool(new) or len(self._rows[-1]) > len(metrics) + 1)

    def _keep_earlier(self, step: int) -> None:
        """The rows of a file already there that come before ``step`` (a resumed run's); a
        link (symbolic or hard), a FIFO or a giant there is not ours to read (it is replaced)."""
        if self.path.is_symlink():
            return
        try:
            raw = open_regular(self.path, _MAX_CSV_BYTES)
        except (OSError, NotReadable):
            return
        with raw, io.TextIOWrapper(raw, newline="") as f:
            if os.fstat(raw.fileno()).st_nlink != 1:
                return
            reader = csv.DictReader(f)
            if not reader.fieldnames or reader.fieldnames[0] != "step":
                return  # not a metrics file of ours: overwritten
            rows = [r for r in reader if (r.get("step") or "").isdigit()]
            self._columns = list(reader.fieldnames)
        self._rows = [{**r, "step": int(r["step"])} for r in rows if int(r["step"]) < step]
        self._write(whole=True)

    def _write(self, whole: bool) -> None:
        """Append the last row, or write the file anew (replaced: a link planted at the path
        is never written through, see evendp._core._files)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = None if whole or len(self._rows) == 1 else open_append(self.path)
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, self._columns, restval="")
        if fd is None:
            writer.writeheader()
            writer.writerows(self._rows)
            replace_file(self.path, text.getvalue().encode())
            return
        writer.writerow(self._rows[-1])
        with os.fdopen(fd, "wb") as f:
            f.write(text.getvalue().encode())


class TensorBoardLogger(MetricLogger):
    """Scalars to a TensorBoard event file in ``log_dir`` (``torch.utils.tensorboard``).

    >>> log = TensorBoardLogger(getfixture("tmp_path"))
    >>> log.log_metrics({"train/loss": 2.5}, step=1)
    >>> log.close()
    >>> len(list(log.log_dir.glob("events.out.tfevents.*")))
    1
    """

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(validate_path("log_dir", log_dir))
        _needs("tensorboard", "TensorBoardLogger", "tensorboard")
        self._writer: Any = None

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._writer is None:  # made at the first write: ranks > 0 create no file
            from torch.utils.tensorboard import SummaryWriter

            # TensorBoard opens its event file with the umask's mode, later, in its own
            # thread: a new log_dir is made 0700 first, so the file is this user's alone.
            mkdir_private(self.log_dir)
            self._writer = SummaryWriter(str(self.log_dir))
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()  # visible to a running TensorBoard now, not in 2 minutes

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class MLflowLogger(MetricLogger):
    """Metrics (and the ``TrainConfig`` as parameters) to an MLflow run.

    ``tracking_uri``: e.g. ``"file:///tmp/mlruns"`` or a server; ``None``: MLflow's default
    (``MLFLOW_TRACKING_URI``). The run is created at the first write and ended by ``close``.
    MLflow allows no ``:`` in names, so ``memory/cpu:0`` is logged as ``memory/cpu_0``.

    MLflow 3 refuses a ``file://`` store unless ``MLFLOW_ALLOW_FILE_STORE=true``:

    >>> import os, tempfile, pathlib
    >>> from unittest import mock
    >>> uri = pathlib.Path(tempfile.mkdtemp()).as_uri()
    >>> with mock.patch.dict(os.environ, MLFLOW_ALLOW_FILE_STORE="true"):
    ...     log = MLflowLogger(tracking_uri=uri, experiment="doc")
    ...     log.log_metrics({"train/loss": 2.5, "memory/cpu:0": 1024}, step=1)
    ...     log.close()
    ...     [m.value for m in log.client.get_metric_history(log.run_id, "train/loss")]
    [2.5]
    """

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str = "evendp",
        run_name: str | None = None,
    ) -> None:
        validate_instance("tracking_uri", tracking_uri, str, "a str", allow_none=True)
        validate_instance("experiment", experiment, str, "a str")
        validate_instance("run_name", run_name, str, "a str", allow_none=True)
        tracking = _needs("mlflow.tracking", "MLflowLogger", "mlflow")
        try:
            self.client = tracking.MlflowClient(tracking_uri)
        except Exception as exc:  # mlflow's own refusal (an unsupported store, say)
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise EvendpError(
                f"MLflowLogger: mlflow cannot use tracking_uri={tracking_uri!r} "
                f"({type(exc).__name__}: {first}); pass the URI of your tracking server, or a "
                "local 'file:' folder with MLFLOW_ALLOW_FILE_STORE=true"
            ) from exc
        self.experiment, self.run_name = experiment, run_name
        self.run_id: str | None = None  # the run written to last (kept after close)
        self._open = False

    def _start(self) -> str:
        if not self._open or self.run_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            exp = found.experiment_id if found else self.client.create_experiment(self.experiment)
            self.run_id = self.client.create_run(exp, run_name=self.run_name).info.run_id
            self._open = True
        return self.run_id

    def on_fit_start(self, trainer: Any) -> None:
        config = trainer.config
        if trainer.rank == 0 and dataclasses.is_dataclass(config) and not isinstance(config, type):
            from mlflow.entities import Param

            params = [Param(k, str(v)) for k, v in dataclasses.asdict(config).items()]
            self.client.log_batch(self._start(), params=params)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k.replace(":", "_"), float(v), now, step) for k, v in metrics.items()]
        self.client.log_batch(self._start(), metrics=batch)

    def close(self) -> None:
        if self._open and self.run_id is not None:
            self.client.set_terminated(self.run_id)
            self._open = False


class WandbLogger(MetricLogger):
    """Metrics (and the ``TrainConfig``) to a Weights & Biases run: ``wandb.init(**init)``
    at the first write (e.g. ``project="x", mode="offline"``), ``finish()`` at ``close``.

    Needs ``pip install wandb``; without it the logger says so when made:

    >>> import sys
    >>> saved = sys.modules.get("wandb")
    >>> sys.modules["wandb"] = None  # as if it were not installed
    >>> try:
    ...     WandbLogger(project="x", mode="offline")
    ... except EvendpError as exc:
    ...     print(str(exc).split(";")[1].strip())
    ... finally:
    ...     _ = sys.modules.pop("wandb") if saved is None else sys.modules.update(wandb=saved)
    pip install wandb (or log with evendp.CSVLogger, which needs nothing)
    """

    def __init__(self, **init: Any) -> None:
        self._wandb = _needs("wandb", "WandbLogger", "wandb")
        self.init = init
        self._run: Any = None

    def on_fit_start(self, trainer: Any) -> None:
        config = trainer.config
        if trainer.rank == 0 and dataclasses.is_dataclass(config) and not isinstance(config, type):
            self.init.setdefault(
                "config", {k: str(v) for k, v in dataclasses.asdict(config).items()}
            )

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self._run is None:
            self._run = self._wandb.init(**self.init)
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        if self._run is not None:
            self._run.finish()
            self._run = None
