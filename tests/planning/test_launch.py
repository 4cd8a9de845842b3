"""Launch planning (devices, batch sizes, torchrun command) and one real torchrun run on CPU."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import evendp._planning._launch as launch_mod
from evendp._core._errors import EvendpError, PlanError
from evendp._distributed._batch_plan import batch_sizes_from_env
from evendp._distributed._sampler import UnevenBatchSampler
from evendp._planning._launch import launch, plan_launch, torchrun_command
from evendp._planning._speed import SpeedBalancer
from tests.planning.test_devices import FakeGpu, FakeNvml, GiB


def gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu("A", 16 * GiB, 4 * GiB),
            FakeGpu("B", 16 * GiB, 12 * GiB),
            FakeGpu("C", 16 * GiB, 8 * GiB),
        ]
    )


def test_cpu_given_sizes_fix_rank_count() -> None:
    plan = plan_launch(nproc="auto", batch_sizes="3,5", nvml=FakeNvml(None))
    assert plan.nproc_per_node == 2
    assert plan.batch_sizes == [3, 5]
    assert plan.physical_devices is None
    assert plan.env == {"EVENDP_BATCH_SIZES": "3,5"}


def test_cpu_batch_split_evenly() -> None:
    plan = plan_launch(nproc=3, batch=16, nvml=FakeNvml(None))
    assert plan.batch_sizes == [6, 5, 5]
    assert "evenly" in plan.describe()


def test_cpu_auto_uses_cpu_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    plan = plan_launch(nproc="auto", nvml=FakeNvml(None))
    assert plan.nproc_per_node == 5
    assert plan.batch_sizes is None and plan.env == {}


def test_gpu_batch_split_by_free_memory_freest_first() -> None:
    plan = plan_launch(nproc="auto", batch=48, nvml=gpus())
    # Freest first: GPU 1 (12 GiB) is logical 0 and rank 0; sizes follow free memory 12:8:4.
    assert plan.physical_devices == [1, 2, 0]
    assert plan.batch_sizes == [24, 16, 8]
    assert plan.env == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": "1,2,0",
        "EVENDP_BATCH_SIZES": "24,16,8",
    }


def test_gpu_nproc_takes_freest() -> None:
    plan = plan_launch(nproc=2, batch=10, nvml=gpus())
    assert plan.physical_devices == [1, 2]
    assert plan.batch_sizes == [6, 4]


def test_gpu_given_devices_and_sizes() -> None:
    plan = plan_launch(gpu_ids=[0, 2], batch_sizes=[3, 5], nvml=gpus())
    assert plan.physical_devices == [0, 2]
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "0,2"
    assert plan.env["EVENDP_BATCH_SIZES"] == "3,5"


def test_multi_node_sizes_cover_all_ranks() -> None:
    plan = plan_launch(batch_sizes="1,2,3,4", nnodes=2, nvml=FakeNvml(None))
    assert plan.nproc_per_node == 2
    assert plan.env["EVENDP_BATCH_SIZES"] == "1,2,3,4"
    plan = plan_launch(nproc=2, batch=8, nnodes="2", nvml=gpus())
    assert plan.batch_sizes == [2, 2, 2, 2]  # other nodes' memory is unknown: even


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"batch": 9, "batch_sizes": "3,5"},
            "--batch 9 .*contradicts --batch-sizes 3,5 .*--batch 8",
        ),
        ({"nproc": 3, "batch_sizes": "3,5"}, "--nproc 3 but --batch-sizes"),
        ({"nproc": 0}, "positive int or 'auto'"),
        ({"nproc": "many"}, "positive int or 'auto'"),
        ({"batch": 0}, "--batch must be a positive int"),
        ({"batch_sizes": "3,x"}, "'x' is not an int"),
        ({"batch_sizes": "0,0"}, "all batch sizes are zero"),
        ({"batch_sizes": "1,2,3", "nnodes": 2}, "3 entries for 2 nodes"),
        ({"batch": 8, "nnodes": "1:4"}, "elastic range"),
        ({"nnodes": "a:a"}, "--nnodes 'a:a' is not an int or MIN:MAX range"),  # was a traceback
        ({"nnodes": "0:0"}, "--nnodes must be an int in"),  # was taken as 0 nodes
        ({"gpu_ids": [0, 1]}, "no NVIDIA driver"),
    ],
)
def test_plan_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(EvendpError, match=message):
        plan_launch(nvml=FakeNvml(None), **kwargs)  # type: ignore[arg-type]


def test_gpu_plan_errors() -> None:
    with pytest.raises(EvendpError, match="GPU id 5 is not a physical device"):
        plan_launch(gpu_ids=[5], nvml=gpus())
    with pytest.raises(EvendpError, match="names 2 GPUs but 3 ranks"):
        plan_launch(nproc=3, gpu_ids=[0, 1], nvml=gpus())
    with pytest.raises(EvendpError, match="asked for 4 GPU"):
        plan_launch(nproc=4, nvml=gpus())


# --------------------------------------------------------------------------------------------
# Planned sizes (a model given): the planner's DDP split, and each rank's memory cap


def small_net() -> nn.Module:
    # ~4.4 KB of activations per sample: 64 MiB holds a few thousand samples.
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))


MODEL: dict[str, Any] = {
    "model": small_net,
    "example_batch": torch.randn(1, 256),
    "plan_options": {"cuda_context": 0, "optimizer": None},
}


def plan_declared(batch: int | None = None) -> launch_mod.LaunchPlan:
    """The planned launch of ``small_net`` on declared 64, 64 and 32 MiB CPU ranks."""
    return plan_launch(batch=batch, nvml=False, memory="64MiB,64MiB,32MiB", **MODEL)


@pytest.fixture(scope="module")
def planned() -> launch_mod.LaunchPlan:
    """The largest batch (planned once per module)."""
    return plan_declared()


def test_model_largest_batch_on_declared_memory(planned: launch_mod.LaunchPlan) -> None:
    sizes, caps = planned.batch_sizes, planned.batch_caps
    assert planned.nproc_per_node == 3 and planned.physical_devices is None
    assert sizes is not None and caps is not None and len(sizes) == len(caps) == 3
    assert sizes[0] == sizes[1] > sizes[2] > 0  # the half-size rank gets fewer samples
    assert all(n <= c for n, c in zip(sizes, caps, strict=True))
    # Half the memory, less the same fixed cost (parameters, gradients, buckets): under half.
    assert 2.0 < caps[0] / caps[2] < 2.3
    p = planned.memory_plan
    assert p is not None and p.mode == "ddp" and p.split == sizes
    assert caps == [d.max_batch_alone for d in p.devices]
    # One channel: the caps ride with the sizes (EVENDP_BATCH_CAPS is no longer written).
    assert planned.env == {
        "EVENDP_BATCH_SIZES": ",".join(map(str, sizes)) + ";caps=" + ",".join(map(str, caps)),
    }
    assert planned.batch_plan is not None and planned.batch_plan.source == "planned for memory"
    assert f"memory caps {caps}" in planned.describe() and "planned (ddp)" in planned.describe()


def test_model_given_batch_is_split_by_the_planner(planned: launch_mod.LaunchPlan) -> None:
    assert planned.batch_caps is not None
    caps = planned.batch_caps
    batch = sum(caps) * 9 // 10
    got = plan_declared(batch)
    assert got.batch_sizes is not None and sum(got.batch_sizes) == batch
    assert got.batch_sizes[2] < got.batch_sizes[0]
    assert got.batch_caps == caps  # a rank's cap does not depend on the global batch
    with pytest.raises(PlanError, match="does not fit"):
        plan_declared(sum(caps) + 1)


def test_model_on_live_gpu_memory_freest_first() -> None:
    # NVML (faked) says GPUs 0, 1, 2 have 4, 12 and 8 GiB free; a wide layer makes the
    # activations, not the parameters, decide how much each holds.
    def wide() -> nn.Module:
        return nn.Sequential(nn.Linear(4096, 16384), nn.ReLU(), nn.Linear(16384, 10))

    plan = plan_launch(
        nvml=gpus(),
        model=wide,
        example_batch=torch.randn(1, 4096),
        plan_options={"optimizer": None},
    )
    assert plan.physical_devices == [1, 2, 0]
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "1,2,0"
    assert plan.batch_sizes is not None and plan.batch_caps is not None
    assert plan.batch_sizes[0] > plan.batch_sizes[1] > plan.batch_sizes[2] > 0
    assert plan.memory_plan is not None
    assert [d.name for d in plan.memory_plan.devices] == ["gpu1", "gpu2", "gpu0"]
    assert [d.free for d in plan.memory_plan.devices] == [12 * GiB, 8 * GiB, 4 * GiB]


def test_declared_memory_without_model_splits_by_it() -> None:
    plan = plan_launch(batch=30, memory="2GiB,1GiB", nvml=False)
    assert plan.nproc_per_node == 2 and plan.batch_sizes == [20, 10]
    assert plan.batch_caps is None and "EVENDP_BATCH_CAPS" not in plan.env
    assert "declared memory" in plan.describe()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": small_net}, "needs example_batch"),
        ({"model": small_net, "example_batch": torch.randn(1, 256)}, "--memory"),
        ({**MODEL, "memory": "1GiB", "batch_sizes": "3"}, "nothing to plan"),
        ({**MODEL, "memory": "2x1GiB", "nnodes": 2}, "this node's devices only"),
        ({**MODEL, "memory": "2x1GiB", "nproc": 3}, "--memory declares 2 devices"),
        ({"example_batch": torch.randn(1, 256)}, "only apply when planning a model"),
        ({**MODEL, "memory": "1GiB", "plan_options": {"mode": "dp"}}, "may not set"),
        ({**MODEL, "memory": "24 furlongs"}, "cannot read device entry"),
    ],
)
def test_model_plan_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(EvendpError, match=message):
        plan_launch(nvml=FakeNvml(None), **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The caps reach SpeedBalancer through the environment


def test_speed_balancer_reads_caps_from_launch_env(
    planned: launch_mod.LaunchPlan, monkeypatch: pytest.MonkeyPatch
) -> None:
    caps = planned.batch_caps
    assert caps is not None
    batch = sum(caps) * 4 // 10  # room to move, but not enough for the fast rank's wish
    plan = plan_declared(batch)
    for key, value in plan.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORLD_SIZE", "3")

    def balancer() -> SpeedBalancer:
        sizes = batch_sizes_from_env()
        # Rank 2 (the small-memory one) is ten times faster than the others.
        timings = [(1.0, sizes[0]), (1.0, sizes[1]), (0.1, sizes[2])]
        return SpeedBalancer(sizes, warmup=2, gather=lambda mine: timings)

    capped = balancer()
    assert capped.caps == caps
    assert [capped.step() for _ in range(2)] == [False, True]
    got = capped.batch_sizes
    assert sum(got) == batch and got[2] == caps[2]  # speed wants more; memory says no
    assert all(n <= c for n, c in zip(got, caps, strict=True))

    monkeypatch.setenv("EVENDP_BATCH_SIZES", ",".join(map(str, plan.batch_sizes or [])))
    free = balancer()  # without the caps the same timings would overfill rank 2
    assert free.caps is None
    free.step(), free.step()
    assert free.batch_sizes[2] > caps[2]


def test_speed_balancer_env_caps_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    sampler = UnevenBatchSampler(range(64), [4, 4], rank=0, world_size=2)
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "4,4;caps=6")
    with pytest.raises(EvendpError, match="1 caps for 2 ranks"):
        SpeedBalancer(sampler.batch_sizes)
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "4,4;caps=4,x")
    with pytest.raises(EvendpError, match="'x' is not an int"):
        SpeedBalancer(sampler.batch_sizes)
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "4,4;caps=3,6")
    with pytest.raises(
        EvendpError, match=r"rank 0 takes 4 samples per step but its memory holds 3"
    ):
        SpeedBalancer(sampler.batch_sizes)
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "4,4;caps=6,9")
    assert SpeedBalancer(sampler.batch_sizes).caps == [6, 9]
    assert SpeedBalancer(sampler.batch_sizes, caps=[8, 8]).caps == [8, 8]  # explicit caps win


def test_command_single_node_gets_free_port_never_29500(monkeypatch: pytest.MonkeyPatch) -> None:
    ports = iter([29500, 41234])

    class FakeSocket:
        def __init__(self, *args: object) -> None:
            self.port = next(ports)

        def __enter__(self) -> FakeSocket:
            return self

        def __exit__(self, *args: object) -> None:
            pass

        def bind(self, addr: object) -> None:
            pass

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(launch_mod.socket, "socket", FakeSocket)
    plan = plan_launch(nproc=2, nvml=False)
    cmd = torchrun_command(plan, "s.py", ["-x"])
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--master-port") + 1] == "41234"
    assert cmd[-2:] == ["s.py", "-x"]


def test_command_passes_multi_node_options_unchanged() -> None:
    plan = plan_launch(nproc=2, nvml=False)
    cmd = torchrun_command(
        plan,
        "s.py",
        [],
        {
            "nnodes": "2",
            "node_rank": "1",
            "rdzv_backend": "c10d",
            "rdzv_endpoint": "head:29400",
            "rdzv_id": "job7",
            "master_addr": None,
        },
    )
    assert cmd[3:] == [
        "--nproc-per-node",
        "2",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "head:29400",
        "--rdzv-id",
        "job7",
        "s.py",
    ]
    with pytest.raises(EvendpError, match="unknown torchrun option"):
        torchrun_command(plan, "s.py", [], {"nproc_per_node": 3})


_PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    out = {k: os.environ.get(k) for k in
           ("RANK", "WORLD_SIZE", "MASTER_PORT", "EVENDP_BATCH_SIZES", "CUDA_VISIBLE_DEVICES")}
    out["sum"] = t.item()
    out["argv"] = sys.argv[1:]
    with open(os.path.join(sys.argv[1], f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
    """
)


@pytest.mark.multiprocess
def test_launch_runs_torchrun_with_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("EVENDP_BATCH_SIZES", raising=False)
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    plan = plan_launch(nproc=2, batch_sizes="3,5", nvml=False)
    unset = ("CUDA_VISIBLE_DEVICES", "EVENDP_BATCH_SIZES")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    code = launch(str(script), [str(tmp_path), "--flag"], plan=plan, env=env)
    assert code == 0
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert res["RANK"] == str(r)
        assert res["WORLD_SIZE"] == "2"
        assert res["EVENDP_BATCH_SIZES"] == "3,5"
        assert res["MASTER_PORT"] != "29500"
        assert res["sum"] == 3.0
        assert res["argv"] == [str(tmp_path), "--flag"]
        assert res["CUDA_VISIBLE_DEVICES"] is None  # CPU plan leaves devices alone
    assert "EVENDP_BATCH_SIZES" not in env  # the env handed in is not modified
    assert "EVENDP_BATCH_SIZES" not in os.environ  # nor the launcher's own


_WORKER = textwrap.dedent(
    """
    import os, signal, sys, time
    from pathlib import Path

    out = Path(sys.argv[1])
    rank = os.environ["RANK"]

    def stop(signum, frame):
        (out / f"stopped{rank}").write_text(str(signum))
        sys.exit(0)

    if sys.argv[2] == "handler":
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
    (out / f"outcome{rank}").write_text(os.environ.get("EVENDP_OUTCOME", ""))
    (out / f"pid{rank}").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)
    """
)


def _launcher(tmp_path: Path, mode: str) -> tuple[Any, list[int]]:
    import subprocess
    import time

    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    env = {k: v for k, v in os.environ.items() if k != "EVENDP_BATCH_SIZES"}
    cmd = [sys.executable, "-m", "evendp", "launch", "--nproc", "2", "--batch-sizes", "1,1"]
    proc = subprocess.Popen(
        [*cmd, str(script), str(tmp_path), mode],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    end = time.monotonic() + 120
    while time.monotonic() < end and not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):
        time.sleep(0.05)
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    time.sleep(0.3)  # the handlers are installed before the pid files are written
    return proc, pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone(pids: list[int], within: float) -> bool:
    import time

    end = time.monotonic() + within
    while time.monotonic() < end:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.multiprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_launcher_stops_torchrun_and_every_rank(tmp_path: Path) -> None:
    import signal

    proc, pids = _launcher(tmp_path, "plain")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    # torchrun receives SIGTERM when its parent dies and stops its workers: nobody trains on.
    assert _gone(pids, 40), [p for p in pids if _alive(p)]
    # ... and says so in one line, no traceback; the dead launcher's outcome folder goes too.
    output = proc.stdout.read()  # to its end: torchrun, the last writer, has exited
    assert "torchrun got SIGTERM (its launcher died) and stopped every rank" in output, output
    assert "Traceback" not in output and "SignalException" not in output, output
    outcome = Path((tmp_path / "outcome0").read_text())
    assert outcome.parent.name.startswith("evendp-outcome-")
    assert not outcome.parent.exists()


@pytest.mark.multiprocess
def test_a_hang_up_or_ctrl_c_reaches_the_ranks_not_torchrun(tmp_path: Path) -> None:
    import signal

    proc, pids = _launcher(tmp_path, "handler")
    os.kill(proc.pid, signal.SIGHUP)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGHUP, output
    assert _gone(pids, 10)
    # Each rank got SIGTERM itself and stopped cleanly: torchrun printed no SignalException.
    assert [(tmp_path / f"stopped{r}").read_text() for r in (0, 1)] == ["15", "15"]
    assert "Traceback" not in output and "SignalException" not in output, output


@pytest.mark.multiprocess
def test_a_killed_rank_is_one_line_not_torchruns_report(tmp_path: Path) -> None:
    """Issue 34: kill -9 of a rank printed torchrun's ChildFailedError (its traceback and a
    table, ~40 lines) and no line of evendp's. A launch of its own: only torchrun writes that
    report, and these workers import nothing (they start in milliseconds)."""
    import signal

    proc, pids = _launcher(tmp_path, "plain")
    os.kill(pids[0], signal.SIGKILL)
    output, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1, output
    assert _gone(pids, 10)
    said = [line for line in output.splitlines() if line.startswith("evendp launch: rank")]
    assert len(said) == 1 and said[0].startswith("evendp launch: rank 0 was killed by SIGKILL")
    assert "; torchrun stopped the run (its report: " in said[0], output
    assert "Traceback" not in output and "ChildFailedError" not in output, output
    assert "failed (exitcode" not in output, output  # torchrun's own log: in the file
    # Issue 34: torchrun's report kept in a file of this user's alone, named by the line.
    kept = Path(said[0].rsplit("(its report: ", 1)[1].rstrip(")"))
    try:
        assert oct(kept.parent.stat().st_mode & 0o777) == "0o700", kept
        assert oct(kept.stat().st_mode & 0o777) == "0o600", kept  # issue 53: was 0644
        report = kept.read_text()
        assert "ChildFailedError" in report or "exitcode" in report, report
        assert "local_rank" in report, report
    finally:
        kept.unlink(missing_ok=True)


@pytest.mark.multiprocess
def test_a_signal_before_training_began_does_not_wait_for_a_stuck_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 34: SIGTERM while a rank was stuck before training waited --comm-timeout + 60 s
    (11 minutes by default). Until the ranks say training began, the launcher tells torchrun
    after START_ESCALATE_S and kills the ranks still there 5 s later (1 s each here). The light
    workers of the tests above (they import nothing): a launch of its own, of milliseconds."""
    import signal
    import threading
    import time

    from evendp._distributed import _interrupt
    from evendp._planning._launch import launch_with_outcome

    monkeypatch.setattr(_interrupt, "START_ESCALATE_S", 1.0)
    monkeypatch.setattr(_interrupt, "_KILL_GRACE_S", 1.0)
    monkeypatch.delenv("EVENDP_BATCH_SIZES", raising=False)
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)

    def stick_rank1_then_signal() -> None:
        end = time.monotonic() + 120
        while time.monotonic() < end and not all((tmp_path / f"pid{r}").exists() for r in (0, 1)):
            time.sleep(0.05)
        time.sleep(0.3)  # the handlers are installed before the pid files are written
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGSTOP)  # stuck at start-up
        os.kill(os.getpid(), signal.SIGTERM)  # to the launcher: this process

    threading.Thread(target=stick_rank1_then_signal, daemon=True).start()
    plan = plan_launch(nproc=2, batch_sizes="1,1", nvml=False)
    started = time.monotonic()
    code, _ = launch_with_outcome(
        str(script), [str(tmp_path), "handler"], plan=plan, comm_timeout=600, trainer=True
    )
    took = time.monotonic() - started
    pids = [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]
    assert code == 128 + signal.SIGTERM and _gone(pids, 10), (code, pids)
    assert took < 60, took  # was 660 s: the comm timeout and a minute
    assert (tmp_path / "stopped0").read_text() == "15"  # the answering rank stopped cleanly


def test_the_quiet_torchrun_reads_the_launchers_outcome_variable() -> None:
    # __main__.py imports nothing of evendp, so it spells the variable itself.
    import runpy

    from evendp._distributed._torchrun import QUIET_TORCHRUN
    from evendp._planning._launch import ENV_OUTCOME

    spelled = runpy.run_path(str(QUIET_TORCHRUN / "_quiet.py"), run_name="probe")
    assert spelled["ENV_OUTCOME"] == ENV_OUTCOME


@pytest.mark.multiprocess
def test_a_script_that_reads_the_sizes_gets_no_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "ported.py"
    script.write_text(
        "import sys, evendp\n"
        "from evendp import UnevenBatchSampler\n"
        "sizes = [int(v) for v in sys.argv[1].split(',')]  # parsed by hand, then used\n"
        "UnevenBatchSampler(range(8), sizes, rank=0)\n"
    )
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != "EVENDP_BATCH_SIZES"}
    env["PYTHONPATH"] = os.pathsep.join([str(root / "src"), env.get("PYTHONPATH", "")])
    plan = plan_launch(nproc=1, batch_sizes="3", nvml=False)
    assert launch(str(script), ["3"], plan=plan, env=env) == 0
    assert "no rank read" not in capsys.readouterr().err


def test_the_ranks_mark_the_launchers_folder_only_when_they_read_its_sizes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from evendp import UnevenBatchSampler, batch_sizes_from_env
    from evendp._distributed import _first_step, _launch_notes
    from evendp._distributed._launch_notes import sizes_were_read

    monkeypatch.setattr(_launch_notes, "_read_here", False)

    outcome = tmp_path / "outcome.json"
    monkeypatch.setenv("EVENDP_OUTCOME", str(outcome))
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "1,3")
    UnevenBatchSampler(8, [4, 4], rank=0)  # its own sizes: not the launcher's
    batch_sizes_from_env(environ={"EVENDP_BATCH_SIZES": "1,3"})  # not the process's env
    assert not sizes_were_read(outcome)
    batch_sizes_from_env()
    assert sizes_were_read(outcome)
    (tmp_path / "sizes-read").unlink()
    monkeypatch.setattr(_launch_notes, "_read_here", False)
    # A script that parsed the sizes itself: a sampler built with them. The sampler touches
    # no file; the launcher's wrapper asks at the first step (or the end) and marks.
    monkeypatch.setattr(_first_step, "_SAMPLED", set())  # no sampler built yet in the script
    # The hook the wrapper installs once the script imports the sampler.
    monkeypatch.setattr(
        UnevenBatchSampler, "__init__", _first_step.observed(UnevenBatchSampler.__init__)
    )
    assert not _first_step._read_through_a_sampler() and not sizes_were_read(outcome)
    UnevenBatchSampler(8, [1, 3], rank=1)
    assert not sizes_were_read(outcome)
    assert _first_step._read_through_a_sampler() and sizes_were_read(outcome)


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="lists sockets through /proc")
def test_a_host_name_that_resolves_to_loopback_keeps_every_listener_on_loopback() -> None:
    """Issue 35: ``--master-addr <this machine's name>`` put the store on every interface
    (``*:P``) although the name resolves to 127.0.0.1 (Debian maps it so). The name is
    resolved: a store served as evendp's torchrun serves it listens on loopback alone, and
    the ranks' gloo and NCCL sockets are told to."""
    import socket

    import torch.distributed as dist

    from evendp._distributed._torchrun._quiet import bound_store_class
    from evendp._planning._launch import interface_env
    from tests.cli.test_train_faults import _listening, _loopback

    name = socket.gethostname()
    found = {info[4][0] for info in socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)}
    if not all(_loopback(str(address)) for address in found):
        pytest.skip(f"this machine's name {name!r} resolves off loopback: {sorted(found)}")
    torchrun = ["python", "-m", "torch.distributed.run", "--master-addr", name]
    assert interface_env(torchrun) == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    server = bound_store_class(dist.TCPStore)(name, 0, None, True, wait_for_workers=False)
    listening = {(ip, port) for ip, port in _listening(os.getpid()) if port == server.port}
    assert listening and all(_loopback(ip) for ip, _ in listening), listening


def test_machines_of_other_sizes_share_one_list_of_sizes() -> None:
    """Issue 35: a 2-GPU box beside a 1-GPU box: each node's ranks are its own (--nproc), the
    sizes name every rank of the run, node 0's first; the ranks check the total."""
    two = plan_launch(nproc=2, nnodes=2, batch_sizes="3,2,1", nvml=False)
    one = plan_launch(nproc=1, nnodes=2, batch_sizes="3,2,1", nvml=False)
    assert (two.nproc_per_node, one.nproc_per_node) == (2, 1)
    assert two.batch_sizes == one.batch_sizes == [3, 2, 1]
    assert plan_launch(nnodes=2, batch_sizes="3,2,1,1", nvml=False).nproc_per_node == 2
    with pytest.raises(EvendpError, match=r"this node.s 3 rank.s. and at least one on each"):
        plan_launch(nproc=3, nnodes=2, batch_sizes="3,2,1", nvml=False)
    with pytest.raises(EvendpError, match="not the same number per node; give --nproc"):
        plan_launch(nnodes=2, batch_sizes="3,2,1", nvml=False)
