"""The host-read counter (tests/_host_reads.py) that tests/training/test_host_reads.py uses:
it counts each read of a tensor's value once, no pure tensor op, names the frame that asked,
and leaves torch as it found it."""

from __future__ import annotations

import math
import threading
from pathlib import Path
from typing import Any

import torch

import evendp
from tests._host_reads import HostReads, culprits, optimizer_steps


def _kinds(reads: HostReads) -> list[str]:
    return [r.kind for r in reads.reads]


def test_counts_each_read_once() -> None:
    net = torch.nn.Linear(3, 1)
    loss = net(torch.ones(2, 3)).pow(2).mean()
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in net.parameters() if p.grad is not None])
    flag = torch.isfinite(norm)
    with HostReads() as reads:
        loss.item()
        float(norm)
        math.isfinite(norm)  # float() inside, once
        bool(flag)
        if flag:  # an if reads as bool() does
            pass
        torch.arange(3).tolist()
        int(torch.tensor(2))
        [0, 1, 2][torch.tensor(1)]  # __index__
        f"{norm:.3f}"  # __format__ reads via item(): still one read
        torch.equal(norm, norm)
        torch.is_nonzero(flag)
    assert _kinds(reads) == [
        "item", "__float__", "__float__", "__bool__", "__bool__", "tolist", "__int__",
        "__index__", "__format__", "equal", "is_nonzero",
    ]  # fmt: skip


def test_size_from_values_counts() -> None:
    """Ops whose output size depends on the values wait for a GPU as a read does."""
    v = torch.arange(4.0)
    with HostReads() as reads:
        v.nonzero()
        v[v > 1]
        v.unique()
        v[torch.tensor([0, 2])]  # an integer index: no wait
    assert _kinds(reads) == ["nonzero", "__getitem__[bool mask]", "unique"]


def test_pure_tensor_ops_do_not_count() -> None:
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters())
    with HostReads(ignore=optimizer_steps(lambda: opt)) as reads:
        for _ in range(2):
            loss = torch.nn.functional.cross_entropy(
                net(torch.randn(4, 3)), torch.tensor([0, 1, 1, 0])
            )
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            ok = torch.isfinite(norm).all()
            torch.where(ok, norm, torch.zeros(()))
            opt.step()
            opt.zero_grad()
    assert reads.reads == []


def test_optimizer_step_counts_are_reads_without_ignore() -> None:
    """torch's AdamW reads its (host) step count: the ``ignore`` above is what hides it."""
    net = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(net.parameters())
    net(torch.ones(1, 3)).sum().backward()
    with HostReads() as reads:
        opt.step()
    assert reads.reads and {r.kind for r in reads.reads} == {"item"}


def test_names_the_evendp_frame() -> None:
    # A function compiled as if it lived in evendp's package: the culprit is its frame.
    where = str(Path(evendp.__file__).resolve().parent / "_fake_module.py")
    space: dict[str, Any] = {}
    exec(compile("def read_it(t):\n    return float(t)\n", where, "exec"), space)
    with HostReads(key=lambda: "k") as reads:
        space["read_it"](torch.tensor(1.0))
        float(torch.tensor(2.0))  # this test's own frame: not evendp
    first, second = reads.reads
    assert first.site == first.culprit == "evendp/_fake_module.py:read_it:2"
    assert first.by_evendp and first.key == "k"
    assert not second.by_evendp and second.culprit is None
    assert "test_host_reads_counter.py:test_names_the_evendp_frame" in second.site
    assert list(culprits([first])) == ["evendp/_fake_module.py:read_it"]
    assert "1 x __float__ at evendp/_fake_module.py:read_it:2" in reads.describe()


def test_other_threads_are_not_counted() -> None:
    t = torch.tensor(1.0)
    with HostReads() as reads:
        worker = threading.Thread(target=lambda: float(t))
        worker.start()
        worker.join()
    assert reads.reads == []


def test_restores_torch() -> None:
    before = {n: getattr(torch.Tensor, n) for n in ("item", "__bool__", "__format__", "tolist")}
    equal = torch.equal
    try:
        with HostReads():
            raise RuntimeError("inside")
    except RuntimeError:
        pass
    assert {n: getattr(torch.Tensor, n) for n in before} == before
    assert torch.equal is equal
    assert "__bool__" not in vars(torch.Tensor)  # inherited from TensorBase, as before
    assert not torch.overrides._is_torch_function_mode_enabled()
    with HostReads() as reads:
        pass
    float(torch.tensor(1.0))  # after the block: not counted
    assert reads.reads == []
