"""``evendp train`` on two nodes (two torchrun agents on loopback) that lose one another.

Issue 35: a lost node used to hang the other for about ten minutes (torchrun's 300 s exit
barrier in C++, a worker that trained on after its agent was killed, a node whose store went
away that never ended). One run is taken through both faults, each launch pair resuming the
last: ``kill -9`` of node 1's agent, then ``kill -STOP`` of node 1's worker under
``--comm-timeout 10``; a last resume finishes it. Every process of both nodes must be gone
within 60 s of each fault, with one line on each node, and the finished run must equal a
one-node run of the same two ranks bit for bit.

Launches of their own (a reason, as docs/testing.md asks): what is tested is the processes'
life across two agents, which no pool task has.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests._helpers import free_port
from tests.cli.test_train_faults import _listening, _loopback, _step, _tree, _wait_for, _weights

# Two node pairs run at once for each of four links: longer than the suite's 300 s under load.
pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]

STEPS, EVERY, GONE_S = 200, 2, 60.0
ARGS = [
    "--mode", "ddp", "--weights", "3,1", "--batch", "16", "--steps", str(STEPS),
    "--checkpoint-every", str(EVERY), "--comm-timeout", "10", "--no-progress", "--no-plan",
    "--n-layer", "1", "--n-embd", "16", "--block-size", "16", "--max-chars", "20000",
]  # fmt: skip


# A short run for the pairs that only start, compare and stop.
ARGS_SHORT = [
    "--mode", "ddp", "--batch", "16", "--steps", "6", "--checkpoint-every", "6",
    "--no-progress", "--no-plan", "--n-layer", "1", "--n-embd", "16", "--block-size", "16",
    "--max-chars", "20000",
]  # fmt: skip


def _train(*argv: str) -> list[str]:
    return [sys.executable, "-m", "evendp", "train", *ARGS, *argv]


# Node 0's address: a loopback one other than 127.0.0.1, so that the store's listener is seen
# bound to the address --master-addr names, not merely to loopback.
MASTER = "127.0.0.2"

# One intra-op thread per rank in every launch: a rank alone on its "machine" would take both
# cores, a rank beside another one, and their matmuls would sum in another order.
_ENV = {**os.environ, "OMP_NUM_THREADS": "1", "EVENDP_TELL_WAIT_S": "60"}


def _start_nodes(base: Path, port: int, *extra: str) -> list[subprocess.Popen[str]]:
    """Node 0 and node 1 of one run, as two machines start it: each its --node-rank and --out.
    A resume copies nothing by hand: node 1's rank receives rank 0's checkpoint."""
    procs = []
    for node in (0, 1):
        out = str(base / f"node{node}")
        argv = ["--devices", "cpu", "--nnodes", "2", "--node-rank", str(node), "--master-addr",
                MASTER, "--master-port", str(port), "--out", out]  # fmt: skip
        procs.append(
            subprocess.Popen(
                _train(*argv, *extra),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=_ENV,
            )
        )
    return procs


def _alive(pids: list[int]) -> list[int]:
    """The ``pids`` still running (a zombie counts as gone: it only waits to be reaped)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _fault(base: Path, fault: str, *extra: str) -> dict[str, Any]:
    """Start (or resume) both nodes; once node 0 checkpointed twice more, ``fault`` on node 1:
    ``agent`` (SIGKILL of its torchrun) or ``worker`` (SIGSTOP of its rank). Then wait, at
    most GONE_S, for every process of both nodes to be gone."""
    ckpt = base / "node0" / "ckpt.pt"
    goal = (_step(ckpt) or 0) + 2 * EVERY
    assert goal < STEPS
    port = free_port()
    procs = _start_nodes(base, port, *extra)
    try:

        def saved() -> bool:
            if any(p.poll() is not None for p in procs):  # a node ended early: say why
                pytest.fail(f"a node ended before step {goal}: {[p.communicate() for p in procs]}")
            return (_step(ckpt) or 0) >= goal

        _wait_for(saved, 300, f"a checkpoint at {goal}")
        trees = [_tree(p.pid) for p in procs]  # launcher, torchrun, its rank: per node
        assert [len(t) for t in trees] == [3, 3], trees
        listening = _listening(procs[0].pid)
        victim = trees[1][1] if fault == "agent" else trees[1][2]
        sent = time.monotonic()
        os.kill(victim, signal.SIGKILL if fault == "agent" else signal.SIGSTOP)
        everyone = trees[0] + trees[1]
        while _alive(everyone) and time.monotonic() - sent < GONE_S:
            for proc in procs:
                proc.poll()  # reap the launchers
            time.sleep(0.1)
        took, left = time.monotonic() - sent, _alive(everyone)
        for pid in left:  # a hang: ended here, so the test fails on its assertions
            os.kill(pid, signal.SIGKILL)
        outputs = [proc.communicate(timeout=30)[0] for proc in procs]
    finally:
        for proc in procs:
            for pid in _alive(_tree(proc.pid)):
                os.kill(pid, signal.SIGKILL)
            proc.wait()
    return {"took": took, "left": left, "codes": [p.returncode for p in procs],
            "outputs": outputs, "step": _step(ckpt), "port": port,
            "listening": listening}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    base = tmp_path_factory.mktemp("nodes")
    straight = tmp_path_factory.mktemp("straight")
    # The reference: one node running both ranks, beside the first fault.
    argv = ["--devices", "cpu,cpu", "--out", str(straight), "--checkpoint-every", str(STEPS)]
    one_node = subprocess.Popen(
        _train(*argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_ENV
    )
    results: dict[str, Any] = {"base": base, "straight": straight}
    results["agent"] = _fault(base, "agent")
    results["worker"] = _fault(base, "worker", "--resume")
    finish = _start_nodes(base, free_port(), "--resume")
    results["finish"] = [(p.wait(timeout=300), p.communicate()[0]) for p in finish]
    results["one_node"] = (one_node.wait(timeout=300), one_node.communicate()[0])
    return results


def _evendp_lines(output: str) -> list[str]:
    """evendp's lines about how the run ended (not the plan's, the report's or the resume's)."""
    said = ("evendp: error", "evendp launch: node", "evendp launch: the run's store")
    return [line for line in output.splitlines() if line.startswith(said)]


def test_a_killed_agent_ends_both_nodes_in_a_minute_each_saying_one_line(
    runs: dict[str, Any],
) -> None:
    """Node 1's rank stops with its agent (SIGTERM, saving at a step every rank agrees on);
    node 0 waits 15 s for node 1's agent, not torchrun's 300, and names it."""
    agent = runs["agent"]
    node0, node1 = agent["outputs"]
    assert not agent["left"] and agent["took"] < GONE_S, agent
    assert agent["codes"] == [143, 137], agent["outputs"]
    assert "Traceback" not in node0 + node1, agent["outputs"]
    said1 = _evendp_lines(node1)
    assert len(said1) == 1 and said1[0].startswith(
        "evendp: error: torchrun, this node's agent, was killed by SIGKILL"
    ), node1
    lost = [line for line in node0.splitlines() if line.startswith("evendp launch: node 1 did")]
    assert len(lost) == 1 and "within 15 s of node 0" in lost[0], node0
    assert "evendp train: stopped and saved; resume with:" in node0, node0
    assert agent["step"] is not None and agent["step"] > 0  # saved where every rank stopped


def test_a_stopped_worker_on_another_node_ends_both_nodes_in_a_minute(
    runs: dict[str, Any],
) -> None:
    """``kill -STOP`` of node 1's rank: node 0's rank waits --comm-timeout (10 s) and node 0's
    launcher names node 1; node 1's agent sees node 0's store go and ends its stopped rank."""
    worker = runs["worker"]
    node0, node1 = worker["outputs"]
    assert not worker["left"] and worker["took"] < GONE_S, worker
    assert worker["codes"] == [1, 1], worker["outputs"]
    assert "Traceback" not in node0 + node1 and "death signal" not in node0, worker["outputs"]
    said0, said1 = _evendp_lines(node0), _evendp_lines(node1)
    assert len(said0) == 1, node0
    assert said0[0].startswith("evendp: error: a rank on node 1 stopped answering"), node0
    assert len(said1) == 1 and "closed while node 1's ranks ran" in said1[0], node1
    assert worker["step"] is not None and worker["step"] > runs["agent"]["step"]


def test_the_resumed_two_node_run_equals_a_one_node_run_bit_for_bit(runs: dict[str, Any]) -> None:
    """After both faults and their resumes, node 0's weights are those of one node running
    the same two ranks without a fault (issue 35: two loopback agents equal one node)."""
    assert [code for code, _ in runs["finish"]] == [0, 0], runs["finish"]
    for _, output in runs["finish"]:  # a clean end: no C++ stack of a look at a closed store
        assert "frame #" not in output and "Traceback" not in output, output[-3000:]
    assert runs["one_node"][0] == 0, runs["one_node"][1][-2000:]
    ours = _weights(runs["base"] / "node0" / "ckpt.pt")
    theirs = _weights(runs["straight"] / "ckpt.pt")
    assert _step(runs["base"] / "node0" / "ckpt.pt") == STEPS
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), name


def test_node_0s_store_listens_on_the_master_address_alone(runs: dict[str, Any]) -> None:
    """Issue 35: torch's store listens on every interface whatever its address; evendp's
    torchrun binds it to the address --master-addr resolves to (here 127.0.0.2), and every
    other socket of node 0 stays on loopback (gloo: ``GLOO_SOCKET_IFNAME=lo``)."""
    for link in ("agent", "worker"):
        port, listening = runs[link]["port"], runs[link]["listening"]
        assert {(ip, p) for ip, p in listening if p == port} == {(MASTER, port)}, listening
        assert all(_loopback(ip) for ip, _ in listening), listening


def test_each_resume_on_node_1_takes_rank_0s_checkpoint_over_the_process_group(
    runs: dict[str, Any],
) -> None:
    """Issue 35: with one --out per machine node 1 held no ``ckpt.pt`` (rank 0 saves on node
    0), so ``--resume`` there had to be preceded by a copy by hand. Now node 1's rank receives
    it: none at the first resume, an older copy at the second."""
    for output in (runs["worker"]["outputs"][1], runs["finish"][1][1]):
        took = [line for line in output.splitlines() if "took rank 0's" in line]
        assert len(took) == 2 and took[0].startswith("evendp: rank 1: took rank 0's ckpt.pt ("), (
            output[-3000:]
        )
        assert "over the process group" in took[0] and "ckpt.prev.pt" in took[1]


def test_a_node_that_refuses_while_node_0_runs_stops_it_within_seconds(tmp_path: Path) -> None:
    """Issue 35: node 1 refused its command at once, exit 2, while node 0 waited for it until
    killed (309 s). Node 1 now leaves its refusal in node 0's store, and node 0 stops with it.
    A launch pair of its own: two agents."""
    port = free_port()
    common = ["--devices", "cpu,cpu", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(port)]  # fmt: skip
    node0 = subprocess.Popen(
        _train(*common, "--weights", "1,1,1,1", "--node-rank", "0", "--out", str(tmp_path / "0")),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_ENV,
    )  # fmt: skip
    try:
        _wait_for(lambda: _reachable(port) or node0.poll() is not None, 120, "node 0's store")
        started = time.monotonic()
        node1 = subprocess.run(
            _train(*common, "--weights", "1,1,1,-1", "--node-rank", "1",
                   "--out", str(tmp_path / "1")),
            capture_output=True, text=True, env=_ENV, timeout=120,
        )  # fmt: skip
        said0, _ = node0.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        node0.kill()
    assert node1.returncode == 2 and node0.returncode == 2, (node1.stderr, said0)
    assert took < 10, took
    assert node1.stderr.count("\n") == 1 and "was told, and stops too" in node1.stderr
    lines = [line for line in said0.splitlines() if line.startswith("evendp launch: node 1")]
    assert len(lines) == 1 and "refused the run: --weights '1,1,1,-1' must be" in lines[0], said0
    assert "Traceback" not in said0 + node1.stderr


def _run_pairs(tmp_path: Path, weights: str) -> dict[str, Any]:
    """Node 0 with two CPU ranks and node 1 with one, ``--weights`` for the run, and beside
    them one machine of three ranks, the same run (the reference)."""
    port = free_port()
    common = [*ARGS_SHORT, "--weights", weights]
    runs = {
        f"node{node}": _train(*common, "--devices", devices, "--nnodes", "2", "--node-rank",
                              str(node), "--master-addr", MASTER, "--master-port", str(port),
                              "--out", str(tmp_path / f"node{node}"))
        for node, devices in ((0, "cpu,cpu"), (1, "cpu"))
    }  # fmt: skip
    runs["one"] = _train(*common, "--devices", "cpu,cpu,cpu", "--out", str(tmp_path / "one"))
    procs = {
        name: subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=_ENV)
        for name, argv in runs.items()
    }  # fmt: skip
    started = time.monotonic()
    try:
        said = {name: proc.communicate(timeout=240)[0] for name, proc in procs.items()}
    finally:
        for proc in procs.values():
            proc.kill()
    return {"took": time.monotonic() - started, "said": said,
            "codes": {name: proc.returncode for name, proc in procs.items()}}  # fmt: skip


def test_machines_of_two_and_one_ranks_train_as_one_machine_of_three(tmp_path: Path) -> None:
    """Issue 35: a 2-GPU box beside a 1-GPU box in one plan (here CPU ranks): node 0 runs 2
    ranks, node 1 one, ``--weights`` names all three, node 0's first. The weights equal one
    machine of three ranks bit for bit. Launches of their own: two agents and a reference."""
    run = _run_pairs(tmp_path, "2,1,1")
    assert run["codes"] == {"node0": 0, "node1": 0, "one": 0}, run["said"]
    assert "batch sizes [8, 4, 4]" in run["said"]["node1"]
    ours, theirs = _weights(tmp_path / "node0" / "ckpt.pt"), _weights(tmp_path / "one" / "ckpt.pt")
    assert ours.keys() == theirs.keys()
    for name, value in theirs.items():
        assert torch.equal(ours[name], value), (
            name,
            (ours[name].float() - value.float()).abs().max(),
            run["said"],
        )


def test_machines_whose_ranks_are_not_the_weights_count_are_told_so_in_cli_words(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Four weights, but the machines started 2 + 1 ranks: each rank's plan is refused in the
    flags' words (not ``EVENDP_BATCH_SIZES``'s), before any collective but the plans'
    agreement, which stops every rank alike and each machine's first rank says it on its
    machine (both shown end to end by the other-weights pair above)."""
    from evendp._core._errors import EvendpError
    from evendp.cli._train_args import OPTIONS_ENV
    from evendp.cli._train_ddp import _rank_plan

    for name, value in ((OPTIONS_ENV, "{}"), ("EVENDP_BATCH_SIZES", "4,4,4,4"),
                        ("WORLD_SIZE", "3"), ("LOCAL_WORLD_SIZE", "1")):  # fmt: skip
        monkeypatch.setenv(name, value)
    with pytest.raises(EvendpError) as refused:
        _rank_plan(SimpleNamespace(batch=16), 3)
    assert str(refused.value) == (
        "--weights (or an even --batch) gives 4 ranks, but the machines started 3 in all (1 on "
        "this one, from --devices); give one weight per rank of the whole run, node 0's first, "
        "the same list on every machine"
    )


def test_nodes_started_with_other_weights_both_stop_naming_the_option(tmp_path: Path) -> None:
    """Issue 35: node 0 with ``--weights 3,1`` and node 1 with ``1,3`` each trained their own
    plan to exit 0, half the samples never used. The ranks compare their plans and the
    digest of the options every machine must share before the first step; each node's first
    rank now says so on its node (node 1 exited 0 before, with a warning that no rank read its
    sizes). A launch pair of its own: two agents."""
    port = free_port()
    procs = []
    for node, weights in ((0, "3,1"), (1, "1,3")):
        argv = ["--devices", "cpu", "--weights", weights, "--nnodes", "2", "--node-rank",
                str(node), "--master-addr", MASTER, "--master-port", str(port),
                "--out", str(tmp_path / str(node))]  # fmt: skip
        procs.append(subprocess.Popen(_train(*argv), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=_ENV))  # fmt: skip
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    assert [proc.returncode for proc in procs] == [2, 2], outputs
    for output in outputs:
        lines = [line for line in output.splitlines() if line.startswith("evendp")]
        assert len(lines) == 2 and lines[0].startswith(
            "evendp launch: 1 rank(s) on this machine"
        ), output
        assert lines[1] == (
            "evendp train: error: node 1 was started with other options than node 0: "
            "--weights is '1,3' there (rank 1), '3,1' on node 0; start every machine with the "
            "same options but --node-rank, --devices and --out"
        )
        assert "Traceback" not in output and "frame #" not in output, output


# A user's script under evendp launch: it reads the launcher's sizes after starting its group.
_READS_SIZES = """
import torch.distributed as dist
import evendp

evendp.init_distributed("gloo")
print(f"rank {dist.get_rank()} trains {evendp.batch_sizes_from_env()}", flush=True)
evendp.finish_distributed()
"""


def test_launch_machines_started_with_other_batch_sizes_both_stop_naming_the_option(
    tmp_path: Path,
) -> None:
    """Issue 51: two machines under ``evendp launch`` (a user's script, one rank each) with
    ``--batch-sizes 1,3`` and ``3,1`` both exited 0, each rank training its own machine's
    reading. The ranks now compare the launcher's plan and shared options once the script's
    group starts (the agreement ``evendp train`` runs): both machines exit 2 within 30 s, one
    line each naming the option and both values. A launch pair of its own: ``evendp launch``
    runs a user's script, which no ``evendp train`` pair does."""
    script = tmp_path / "reads.py"
    script.write_text(_READS_SIZES)
    port = free_port()
    started = time.monotonic()
    procs = []
    for node, sizes in ((0, "1,3"), (1, "3,1")):
        argv = [sys.executable, "-m", "evendp", "launch", "--nproc", "1", "--nnodes", "2",
                "--node-rank", str(node), "--master-addr", MASTER, "--master-port", str(port),
                "--batch-sizes", sizes, str(script)]  # fmt: skip
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=_ENV, cwd=tmp_path))  # fmt: skip
    try:
        outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
    took = time.monotonic() - started
    assert [proc.returncode for proc in procs] == [2, 2], outputs
    assert took < 30, (took, outputs)
    for node, output in enumerate(outputs):
        sizes = "[1, 3]" if node == 0 else "[3, 1]"
        assert output.splitlines() == [
            f"evendp launch: 1 rank(s) on this machine, CPU (gloo); batch sizes {sizes}",
            "evendp launch: error: node 1 was started with other options than node 0: "
            "--batch-sizes is '3,1' there (rank 1), '1,3' on node 0; start every machine with "
            "the same options but --node-rank, --nproc, --gpus, --min-free and the rendezvous "
            "address",
        ], output  # no rank trained, no traceback, nothing else


def test_a_refusing_node_says_when_node_0_was_not_reached(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from evendp._distributed._torchrun._nodes import ENV_TELL_WAIT
    from evendp.cli import main

    monkeypatch.setenv(ENV_TELL_WAIT, "1")
    argv = ["train", *ARGS, "--devices", "cpu", "--weights", "1,1,1,-1", "--nnodes", "2",
            "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
            str(free_port()), "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    waiting, error = capsys.readouterr().err.splitlines()
    assert waiting.startswith("evendp train: waiting up to 1 s for node 0 at 127.0.0.1:"), waiting
    assert waiting.endswith(
        "to come up, to tell it that node 1 ended the run (Ctrl-C ends the wait)"
    )
    assert error.endswith("was not reached within 1 s: stop it there if it waits)"), error


def _node_1_first(tmp_path: Path, refusing: int) -> tuple[list[str], float]:
    """Node 1 starts, then node 0 once node 1 waits for it; node ``refusing`` is given a
    negative weight, so it refuses, and the other one would train. Both nodes' outputs, and
    the seconds from node 0's start until both ended."""
    port = free_port()
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    procs: dict[int, subprocess.Popen[str]] = {}
    lines: dict[int, list[str]] = {0: [], 1: []}
    readers = []
    for node in (1, 0):
        weights = "1,1,1,-1" if node == refusing else "1,1,1,1"
        argv = ["--devices", "cpu,cpu", "--weights", weights, *common, "--node-rank", str(node),
                "--out", str(tmp_path / str(node))]  # fmt: skip
        procs[node] = subprocess.Popen(_train(*argv), stdout=subprocess.PIPE,
                                       stderr=subprocess.STDOUT, text=True, env=_ENV)  # fmt: skip
        readers.append(threading.Thread(target=lines[node].extend, args=(procs[node].stdout,)))
        readers[-1].start()
        if node == 1:  # it waits: with its refusal, or in its agent's rendezvous
            waiting = lambda: any("waiting up to" in line for line in lines[1])  # noqa: E731
            agent = lambda: len(_tree(procs[1].pid)) >= 2  # noqa: E731
            _wait_for(waiting if refusing == 1 else agent, 120, "node 1 to wait")
            time.sleep(1.0)
            started = time.monotonic()
    try:
        for proc in procs.values():
            proc.wait(timeout=60)
        took = time.monotonic() - started
        for reader in readers:
            reader.join(30)
    finally:
        for proc in procs.values():
            for pid in _alive(_tree(proc.pid)):
                os.kill(pid, signal.SIGKILL)
            proc.wait()
    outputs = ["".join(lines[0]), "".join(lines[1])]
    assert [procs[0].returncode, procs[1].returncode] == [2, 2], outputs
    assert "Traceback" not in "".join(outputs), outputs
    return outputs, took


def test_a_node_that_refused_before_node_0_was_up_stops_it_within_seconds(
    tmp_path: Path,
) -> None:
    """Issue 35: node 1 refused its command before node 0 was up, so node 0, started later,
    waited for node 1 until torchrun's rendezvous timeout. Node 1 now waits for node 0's store
    and leaves its refusal there. A launch pair of its own: no pool task has two agents."""
    (node0, node1), took = _node_1_first(tmp_path, refusing=1)
    assert took < 30, took  # node 0's start, its agent's, its look: ~5 s idle, more loaded
    assert "evendp train: waiting up to 60 s for node 0 at 127.0.0.1:" in node1
    assert "(node 0 at 127.0.0.1:" in node1 and "was told, and stops too)" in node1
    said = [line for line in node0.splitlines() if line.startswith("evendp launch: node 1")]
    assert len(said) == 1 and "node 1 refused the run: --weights '1,1,1,-1' must be" in said[0], (
        node0
    )
    assert said[0].endswith("; node 0 stops too"), said


def test_node_0_refusing_stops_a_node_that_waits_for_it_within_seconds(tmp_path: Path) -> None:
    """Issue 35: node 0 refused its command while node 1's agent waited for node 0's store,
    which never came (torchrun's rendezvous timeout). Node 0 now serves its refusal there
    until node 1 read it. A launch pair of its own: no pool task has two agents."""
    (node0, node1), took = _node_1_first(tmp_path, refusing=0)
    assert took < 30, took  # node 0's start and node 1's look: ~3 s idle, more loaded
    assert node0.strip().endswith("(the other nodes were told, and stop too)"), node0
    said = [line for line in node1.splitlines() if line.startswith("evendp launch: node 0")]
    assert len(said) == 1 and "refused the run: " in said[0], node1
    assert said[0].endswith("; node 1 stops too"), said


def _reachable(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def test_node_0_with_nothing_to_train_ends_the_waiting_nodes_with_exit_0(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Node 0's launcher finds the checkpoint at --steps and exits 0 before its agent starts;
    the other nodes, which leave that check to node 0, would wait for its store. Node 0 now
    serves that word; node 1's watch ends with node 0's code, 0."""
    import threading as threads

    from evendp._distributed._torchrun import _nodes
    from evendp.cli._train_ddp import told_nothing_to_train

    port = free_port()
    codes: list[int] = []
    done = threads.Event()
    _nodes.STOP_WATCHING.clear()
    _nodes.watch_refusals("127.0.0.1", port, 1, workers=list,
                          end=lambda code: (codes.append(code), done.set()))  # fmt: skip
    args = SimpleNamespace(nnodes=2, node_rank=0, master_addr="127.0.0.1", master_port=port)
    assert told_nothing_to_train(args, 0) == 0  # type: ignore[arg-type]
    assert done.wait(30) and codes == [0]
    *waited, said = capsys.readouterr().err.strip().splitlines()
    assert said == (
        "evendp launch: node 0 found nothing to train (its checkpoint is at --steps); node 1 "
        "ends too"
    )
    assert all(line.startswith("evendp train: waiting up to 3 s for the other") for line in waited)
