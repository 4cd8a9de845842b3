"""A hand-written DDP training loop in nanoGPT's shape, every rank with its own batch size.

Run (CPU ranks use gloo; GPUs NCCL):

    evendp launch --nproc 2 --batch-sizes 1,3 examples/nanogpt_loop.py
    python examples/nanogpt_loop.py                # one process

The port of examples/plain/nanogpt_loop.py (the changed lines: docs/integrations.md): the
model still returns this rank's mean loss and micro-batches still accumulate with the next
batch fetched during backward. evendp.StepMean weighs each micro-batch's mean by its samples
(an empty share, a stand-in sample, by exactly 0) and, once per step, makes the gradient the
one of the mean over the step's global batch; its loss is that batch's mean on every rank, so
rank 0 logs it with no collective.
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Subset

import evendp
from evendp import EmptySafeCollate, StepMean, UnevenBatchSampler, batch_sizes_from_env
from evendp.examples.gpt import GPT, GPTConfig
from evendp.examples.stdlib_text import stdlib_dataset


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=512, help="training windows")
    parser.add_argument("--iters", type=int, default=20, help="optimizer steps")
    parser.add_argument("--out", type=Path, help="save each rank's final parameters here")
    cli = parser.parse_args(argv)
    accum, batch, block_size, grad_clip = 2, 4, 16, 1.0

    ddp = int(os.environ.get("RANK", -1)) != -1  # started by torchrun
    owns_group = ddp and not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if ddp else (0, 1)
    device = f"cuda:{os.environ.get('LOCAL_RANK', 0)}" if torch.cuda.is_available() else "cpu"
    master = rank == 0

    train, _, vocab = stdlib_dataset(block_size=block_size, max_chars=20_000)
    ds = Subset(train, range(cli.samples))
    sizes = batch_sizes_from_env(world, default=[batch] * world)  # from `evendp launch`
    sampler = UnevenBatchSampler(ds, sizes, rank=rank, world_size=world, seed=0)
    loader = DataLoader(ds, batch_sampler=sampler, collate_fn=EmptySafeCollate(ds, stand_in=True))

    def batches():  # an endless stream of this rank's batches, epoch after epoch
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            for x, y in loader:
                yield x.to(device), y.to(device)

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=vocab.size, block_size=block_size, n_layer=2, n_embd=32)
    model = GPT(config).to(device)  # dropout 0: the same run on any number of ranks
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if ddp:
        model = DDP(model, device_ids=[torch.device(device).index] if "cuda" in device else None)

    step = StepMean()  # weighs this rank's mean losses; turns the step exact
    stream = batches()
    X, Y = next(stream)  # fetch the very first batch
    for it in range(cli.iters):
        for micro_step in range(accum):
            if ddp:  # all-reduce the gradients only on the last micro-step
                model.require_backward_grad_sync = micro_step == accum - 1
            _, loss = model(X, Y)  # logits, this rank's mean loss
            loss = step.weigh(loss, Y)  # this micro-batch's sum (0 for a stand-in)
            X, Y = next(stream)  # the next batch, fetched while this one runs backward
            loss.backward()
        lossf = step.finish(model).item()  # the global batch's mean (one all-reduce)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if master and it % 5 == 0:
            print(f"iter {it}: loss {lossf:.4f}", flush=True)

    if cli.out is not None:
        raw = model.module if ddp else model
        torch.save(raw.state_dict(), cli.out / f"nanogpt{rank}.pt")
    if owns_group:
        evendp.finish_distributed()  # destroy_process_group, gloo's workers idle first


if __name__ == "__main__":
    main()
