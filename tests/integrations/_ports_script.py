"""Run by test_ports.py under ``evendp launch``: the ports of examples/ in one launch.

Usage: evendp launch --nproc 2 --batch-sizes 1,3 tests/integrations/_ports_script.py OUT_DIR
The ranks share one gloo group (the frameworks find it started); each port saves its final
parameters to OUT_DIR/<port><rank>.pt.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import evendp

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

#: port -> the arguments the tests run it with: 17 samples, so the short last step is [0, 1]
#: (Accelerate's end_training destroys the process group: it runs last.)
PORTS = {
    "hf_trainer": ["--samples", "17"],
    "lightning_module": ["--samples", "17", "--epochs", "2"],
    "nanogpt_loop": ["--samples", "17", "--iters", "4"],
    # [0, 4]: rank 0 is empty at every step (a real empty batch: BatchNorm, accuracy()).
    "imagenet_loop": ["--samples", "17", "--epochs", "2", "--batch-sizes", "0,4"],
    "accelerate_loop": ["--samples", "17", "--epochs", "2"],
}


def run(port: str, out: Path, extra: list[str] | None = None) -> None:
    main = runpy.run_path(str(EXAMPLES / f"{port}.py"), run_name="port")["main"]
    main([*PORTS[port], *(extra or []), "--out", str(out)])


if __name__ == "__main__":
    evendp.init_distributed("gloo")
    for name in PORTS:
        run(name, Path(sys.argv[1]))
    evendp.finish_distributed()
