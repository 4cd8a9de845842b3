"""A standard Hugging Face Accelerate loop with DeepSpeed ZeRO, every rank with its own batch.

Run (CPU ranks use gloo; GPUs NCCL):

    evendp launch --nproc 2 --batch-sizes 1,3 examples/deepspeed_accelerate.py
    evendp launch --nproc 2 --batch-sizes 1,3 examples/deepspeed_accelerate.py --zero-stage 3

The port of examples/plain/deepspeed_accelerate.py (the changed lines: docs/integrations.md),
kohya sd-scripts' shape: the loss is the usual mean, accelerator.accumulate and
accelerator.backward are as they were, and the warm-up schedule steps once per optimizer
step as in one process. Each optimizer step's gradient is the mean over all its
samples on all ranks, exactly, for ZeRO stages 1, 2 and 3.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import PartialState
from accelerate.utils import DeepSpeedPlugin
from torch import nn
from torch.utils.data import TensorDataset

from evendp.integrations.accelerate import UnevenAccelerator, uneven_dataloader


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", type=Path, help="save each rank's final parameters here")
    parser.add_argument("--zero-stage", type=int, default=2, choices=(1, 2, 3))
    cli = parser.parse_args(argv)

    cpu = not torch.cuda.is_available()
    if cpu:  # CPU ranks: a gloo group first, which Accelerate's DeepSpeed then uses
        PartialState(cpu=True)
    deepspeed = DeepSpeedPlugin(
        hf_ds_config={
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": 2,
            "gradient_clipping": 0.0,  # none, as in examples/accelerate_loop.py
            "zero_optimization": {
                "stage": cli.zero_stage,
                "stage3_gather_16bit_weights_on_model_save": True,  # saved whole
            },
            "zero_allow_untested_optimizer": True,  # torch.optim SGD
        }
    )
    accelerator = UnevenAccelerator(deepspeed_plugin=deepspeed, gradient_accumulation_steps=2)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(cli.samples, 16, generator=g)
    data = TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(dim=1))
    loader = uneven_dataloader(accelerator, data, batch_size=8)  # or EVENDP_BATCH_SIZES

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    model, optimizer, loader, warmup = accelerator.prepare(model, optimizer, loader, warmup)

    for epoch in range(cli.epochs):
        for inputs, targets in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                warmup.step()
                optimizer.zero_grad()
        accelerator.print(f"epoch {epoch}: learning rate {warmup.get_last_lr()[0]:.3f}")

    if cli.out is not None:
        params = accelerator.get_state_dict(model)  # every rank: ZeRO-3 gathers them
        torch.save(params, cli.out / f"ds_accelerate{accelerator.process_index}.pt")
    accelerator.end_training()


if __name__ == "__main__":
    main()
