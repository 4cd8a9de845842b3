"""The planner's predicted max batch per device vs the real one on budgeted virtual devices.

Each virtual CPU device enforces its budget (``evendp._training._budget``): resident bytes
(parameters;
on device 0 also the gradients and AdamW state, created by one real step first) plus every
storage the replica's forward allocates. The real maximum is found by search: the largest
share that device runs alone (``fixed_sizes``, every other share 0) without
``torch.OutOfMemoryError``. The prediction is ``plan(...).devices[i].max_batch_alone`` with
no safety margin and no CUDA context (a CPU has none). Ratio = predicted / real: at most 1
means the planner never promises a batch that does not fit.

Not enforced (so not in the real maximum): backward's transient allocations, which run in the
autograd engine's thread, and the gathered outputs on device 0.

    PYTHONPATH=src python benchmarks/planner_budget.py            # the demo's model and budgets
    PYTHONPATH=src python benchmarks/planner_budget.py --json
"""

from __future__ import annotations

import argparse
import json

import torch

from evendp import BalancedDataParallel
from evendp._planning._planner import plan
from evendp._training._budget import MemoryBudgets, tensor_bytes
from evendp._training._trainer import _LossModule, default_loss
from evendp.cli._model_spec import gpt_batch
from evendp.examples.gpt import GPT, GPTConfig


def resident_fn(model: torch.nn.Module, optimizer: torch.optim.Optimizer):  # type: ignore[no-untyped-def]
    params = tensor_bytes(list(model.parameters()))

    def resident(i: int) -> int:
        if i:
            return params
        grads = tensor_bytes([p.grad for p in model.parameters()])
        return params + grads + tensor_bytes(list(optimizer.state.values()))

    return resident


def enforced_max(dp: BalancedDataParallel, config: GPTConfig, i: int, hi: int) -> int:
    def fits(n: int) -> bool:
        sizes = [0] * len(dp.device_ids)
        sizes[i] = n
        x = torch.randint(0, config.vocab_size, (n, config.block_size))
        try:
            with dp.fixed_sizes(sizes):
                dp(x, x)
        except torch.OutOfMemoryError:
            return False
        return True

    lo = 0  # fits(lo) holds; grow hi until it fails, then bisect
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--memory", default="48MiB,48MiB,24MiB")
    p.add_argument("--n-layer", type=int, default=3)
    p.add_argument("--n-embd", type=int, default=64)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    config = GPTConfig(96, args.block_size, args.n_layer, 4, args.n_embd)
    budgets = args.memory.split(",")
    predicted = plan(
        lambda: GPT(config), gpt_batch(config), args.memory, mode="dp", safety_margin=0.0,
        cuda_context=0,
    )  # fmt: skip
    model = GPT(config)
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, config.vocab_size, (2, config.block_size))
    model(x, x)[1].backward()
    optimizer.step()  # AdamW state exists, as in training after step 1
    dp = BalancedDataParallel(_LossModule(model, default_loss), ["cpu"] * len(budgets))
    MemoryBudgets(budgets, resident=resident_fn(model, optimizer)).attach(dp)
    rows = []
    for i, d in enumerate(predicted.devices):
        real = enforced_max(dp, config, i, hi=max(2, d.max_batch_alone))
        ratio = d.max_batch_alone / real if real else None
        rows.append(
            {"device": i, "budget": budgets[i], "predicted": d.max_batch_alone, "real": real,
             "ratio": ratio}
        )  # fmt: skip
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"GPT {args.n_layer}x{args.n_embd}, block {args.block_size}, budgets {args.memory}")
    print("device  budget  predicted max  enforced max  ratio")
    for r in rows:
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(f"{r['device']:>6}  {r['budget']:>6}  {r['predicted']:>13}  {r['real']:>12}  {ratio}")


if __name__ == "__main__":
    main()
