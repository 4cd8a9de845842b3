"""A sweep of interrupts under `evendp train --mode ddp` (gloo, CPU): every signal at every moment.

For each seeded moment, phase (start-up, mid-run, around the last step) and target (rank 0,
rank 1, the launcher) and signal (SIGINT, SIGTERM), one run is interrupted at that moment,
resumed to the end, and its final weights compared with an uninterrupted run's. A case passes
when the run exited 130/143 and its report says ``interrupted: true`` with a checkpoint before
the last step, or, when the signal came after the last step, exited 0 as finished; every rank
is gone, rank 0's checkpoint, rank 1's RNG file and the report agree on the step, no marker
or temporary file is left in OUT, nothing printed a traceback, and the resumed run's weights
equal the uninterrupted run's. Prints one line per case and a summary; exits 1 when a case
fails.

    PYTHONPATH=src python benchmarks/interrupt_sweep.py --moments 1
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from evendp._distributed._interrupt import _children
from tests.cli.test_train_faults import EVERY, STEPS, _start, _step, _workers

TARGETS = [
    ("rank0", signal.SIGINT),
    ("rank1", signal.SIGINT),
    ("launcher", signal.SIGINT),
    ("rank0", signal.SIGTERM),
    ("rank1", signal.SIGTERM),
    ("launcher", signal.SIGTERM),
    ("launcher", signal.SIGKILL),  # torchrun gets SIGTERM (PDEATHSIG): the ranks stop, saved
]
PHASES = ("startup", "mid", "end")


def _until(predicate, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def _catches(pid: int | None, signum: int) -> bool:
    """Whether ``pid`` has a handler of its own for ``signum`` (``SigCgt`` in /proc)."""
    if pid is None:
        return False
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) >> (signum - 1) & 1)


def _aim(  # type: ignore[no-untyped-def]
    out: Path, proc, target: str, phase: str, moment: float, signum: int = signal.SIGINT
) -> int | None:
    """Wait for the phase and the seeded moment in it; the target's pid (None: gone)."""
    if phase == "startup":  # torchrun and the ranks are starting
        # The launcher from the moment it has started torchrun (before, it is importing
        # torch and has no handler yet: a SIGTERM then ends it by the signal, nothing written);
        # a rank from the moment train.py's first lines have set its handlers, before torch:
        # before that no code of ours runs in it, and on a loaded machine that can last well
        # past the moment it appears in /proc. SIGTERM's is the mark: Python catches SIGINT
        # from its own start (KeyboardInterrupt), so a SIGINT caught says nothing of train.py.
        def started() -> bool:
            if target == "launcher":
                return bool(_children(proc.pid))
            workers = _workers(out)
            mine = workers.get(0 if target == "rank0" else 1)
            return len(workers) == 2 and _catches(mine, signal.SIGTERM)

        _until(started, 60)
        time.sleep(moment / 3)
    elif phase == "mid":
        _until(lambda: (_step(out / "ckpt.pt") or 0) >= EVERY, 300)
        time.sleep(moment)
    else:  # around the last step: the last checkpoint but one, then a short while
        _until(
            lambda: (_step(out / "ckpt.pt") or 0) >= STEPS - EVERY or proc.poll() is not None, 300
        )
        time.sleep(moment / 5)
    if target == "launcher":
        return proc.pid if proc.poll() is None else None
    return _workers(out).get(0 if target == "rank0" else 1)


def _leftovers(out: Path) -> list[str]:
    stale = {".interrupted"}
    return sorted(p.name for p in out.iterdir() if p.name in stale or p.name.endswith(".tmp"))


def _same_weights(out: Path, reference: Path) -> float:
    ours = torch.load(out / "ckpt.pt", weights_only=True)["model"]
    theirs = torch.load(reference / "ckpt.pt", weights_only=True)["model"]
    worst = 0.0
    for name, value in theirs.items():
        if not value.is_floating_point():  # GPT's bool attn.mask buffers: equal or not
            worst = max(worst, 0.0 if torch.equal(ours[name], value) else 1.0)
            continue
        scale = value.abs().max().clamp_min(1e-12)
        worst = max(worst, float((ours[name] - value).abs().max() / scale))
    return worst


def interrupt(  # type: ignore[no-untyped-def]
    out: Path, proc, target: str, signum: int, phase: str, moment: float
) -> tuple[list[str], str, str]:
    """Send ``signum`` to ``target`` of the started run ``proc`` at the moment; wait for every
    process to end. The contract's breaches found (none: it held), what happened, the output."""
    pid = _aim(out, proc, target, phase, moment, signum)
    if pid is None:
        output, _ = proc.communicate(timeout=300)
        return [], f"the run ended before the signal (exit {proc.returncode}): not a case", output
    sent = time.monotonic()
    os.kill(pid, signum)
    output, _ = proc.communicate(timeout=180)
    took = time.monotonic() - sent
    problems = []
    # A killed launcher cannot exit 137 itself: the shell sees -9; its ranks still stop.
    expected = -signum if signum == signal.SIGKILL else 128 + signum
    gone = _until(lambda: not _workers(out), 45)
    if not gone:
        problems.append("ranks still running")
    report_path = out / "report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    saved, rng1 = _step(out / "ckpt.pt"), _step(out / "ckpt.rng1.pt")
    if report is None:  # stopped before the first step: nothing to agree on
        if proc.returncode != expected:
            problems.append(f"exit {proc.returncode} before any step, not {expected}")
    elif report["interrupted"]:
        if proc.returncode != expected:
            problems.append(f"exit {proc.returncode}, not {expected}")
        if not (saved is not None and saved < STEPS):
            problems.append(f"interrupted but the checkpoint is at {saved}")
        if "--resume" not in output and signum != signal.SIGKILL:
            problems.append("no resume command printed")
    else:
        if proc.returncode not in (0, expected) or saved != STEPS:
            problems.append(f"not interrupted, yet exit {proc.returncode} at step {saved}")
        if phase != "end":  # long before the last step: the signal must stop the run
            problems.append("the signal was lost: the run trained to the end")
    if report is not None and not (saved == rng1 == report["steps"]):
        problems.append(f"checkpoint {saved}, rank 1 RNG {rng1}, report {report['steps']}")
    # A SIGKILLed launcher leaves torchrun to say why it stopped (its SignalException).
    if "Traceback" in output and signum != signal.SIGKILL:
        problems.append("a traceback: " + output[output.index("Traceback") :][:200])
    if out.exists() and _leftovers(out):
        problems.append(f"left behind {_leftovers(out)}")
    how = (
        "no step done, stopped"
        if report is None
        else ("interrupted" if report["interrupted"] else "finished")
    )
    return problems, f"{how} at step {saved}, all exited {took:.1f} s after it", output


def run_case(
    out: Path, target: str, signum: int, phase: str, moment: float, reference: Path
) -> tuple[bool, str]:
    """One case: a fresh run interrupted, then resumed to the end. (passed, its line)."""
    problems, happened, _ = interrupt(out, _start(out), target, signum, phase, moment)
    resumed = _start(out, "--resume-or-start")
    resumed_out, _ = resumed.communicate(timeout=300)
    if resumed.returncode != 0:
        problems.append(f"resume exit {resumed.returncode}: {resumed_out[-300:]}")
    else:
        worst = _same_weights(out, reference)
        if worst > 1e-5:
            problems.append(f"weights differ (relative {worst:.1e})")
    status = "ok" if not problems else "FAIL: " + "; ".join(problems)
    return not problems, f"{happened}: {status}"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--moments", type=int, default=1, help="seeded moments per case")
    parser.add_argument("--phases", default=",".join(PHASES), help="startup,mid,end")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="evendp-sweep-"))
    reference = root / "straight"
    if _start(reference).wait(timeout=300) != 0:
        print("the uninterrupted run failed")
        return 1
    tried = failures = 0
    for i in range(args.moments):
        for phase in args.phases.split(","):
            for target, signum in TARGETS:
                moment = rng.uniform(0.0, 1.5)
                out = root / f"case{i}-{phase}-{target}-{int(signum)}"
                ok, line = run_case(out, target, int(signum), phase, moment, reference)
                tried, failures = tried + 1, failures + (not ok)
                name = signal.Signals(signum).name
                print(f"{phase:7} {target:8} {name:7} +{moment:.2f} s: {line}", flush=True)
                shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(root, ignore_errors=True)
    print(
        f"{tried} cases, {tried - failures} passed, {failures} failed (torch {torch.__version__})"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
