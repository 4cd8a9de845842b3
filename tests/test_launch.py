"""Launch planning (devices, batch sizes, torchrun command) and one real torchrun run on CPU."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest

import evendp._launch as launch_mod
from evendp._errors import EvendpError
from evendp._launch import launch, plan_launch, torchrun_command
from tests.test_devices import FakeGpu, FakeNvml, GiB


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
    plan = plan_launch(devices=[0, 2], batch_sizes=[3, 5], nvml=gpus())
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
        ({"batch": 8, "batch_sizes": "3,5"}, "not both"),
        ({"nproc": 3, "batch_sizes": "3,5"}, "--nproc 3 but --batch-sizes"),
        ({"nproc": 0}, "positive int or 'auto'"),
        ({"nproc": "many"}, "positive int or 'auto'"),
        ({"batch": 0}, "--batch must be a positive int"),
        ({"batch_sizes": "3,x"}, "'x' is not an int"),
        ({"batch_sizes": "0,0"}, "all batch sizes are zero"),
        ({"batch_sizes": "1,2,3", "nnodes": 2}, "3 entries for 2 nodes"),
        ({"batch": 8, "nnodes": "1:4"}, "elastic range"),
        ({"devices": [0, 1]}, "no NVIDIA driver"),
    ],
)
def test_plan_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(EvendpError, match=message):
        plan_launch(nvml=FakeNvml(None), **kwargs)  # type: ignore[arg-type]


def test_gpu_plan_errors() -> None:
    with pytest.raises(EvendpError, match="GPU id 5 is not a physical device"):
        plan_launch(devices=[5], nvml=gpus())
    with pytest.raises(EvendpError, match="names 2 GPUs but 3 ranks"):
        plan_launch(nproc=3, devices=[0, 1], nvml=gpus())
    with pytest.raises(EvendpError, match="asked for 4 GPU"):
        plan_launch(nproc=4, nvml=gpus())


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
def test_launch_runs_torchrun_with_env(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(_PROBE)
    plan = plan_launch(nproc=2, batch_sizes="3,5", nvml=False)
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
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
    assert "EVENDP_BATCH_SIZES" not in env  # the launcher's own env is untouched
