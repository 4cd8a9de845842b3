"""Every rank trains one batch plan, or every rank stops at once (issue 35).

Nodes started with different ``--batch-sizes`` would each train their own plan (exit 0, the
gradient off), and a rank whose plan is refused would stop alone, the others waiting in their
first collective. So the ranks exchange their plans once, before the first step, in one
all-gather of a fixed-size row each, and every rank decides from the same rows.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist

from .._core._digest import digest_words
from .._core._errors import EvendpError
from ._batch_plan import BatchPlan
from ._group import comm_device

__all__ = ["TRAIN_OWN", "agreed_plan"]

_REFUSED, _HELD = 0, 1
_NO_CAP = -1


#: The options of a run that are each machine's own, as ``evendp train`` names them.
TRAIN_OWN = "--node-rank, --devices and --out"


def agreed_plan(
    build: Callable[[], BatchPlan],
    world: int,
    options: Mapping[str, Any] | None = None,
    *,
    own: str = TRAIN_OWN,
) -> BatchPlan:
    """This rank's plan from ``build()``, once every rank holds the same one (and the same
    ``options``, all a machine is started with but ``own``); else an :class:`EvendpError`
    on every rank alike, naming the ranks (and nodes) that differ. One all-gather; a second
    only to name the first option that differs.
    """
    try:
        plan: BatchPlan | None = build()
        error: EvendpError | None = None
    except EvendpError as exc:
        plan, error = None, exc
    # The options' SHA-256, its first 16 bytes as two int64 ([0, 0]: none given).
    digest = [0, 0] if options is None else digest_words(_canonical(options).encode(), 2)
    rows = _gather([*digest, *_row(plan, world)], world)
    digests, rows = [row[:2] for row in rows], [row[2:] for row in rows]
    if any(d != digests[0] for d in digests):  # every rank sees it: all run the gather below
        raise _every_rank(EvendpError(_options_differ(options or {}, [r[1] for r in rows], own)))
    if error is not None:
        raise _every_rank(error)
    refused = [r for r, row in enumerate(rows) if row[0] == _REFUSED]
    if refused:
        raise _every_rank(
            EvendpError(
                f"rank {refused[0]} (node {rows[refused[0]][1]}) refused its batch plan, so no "
                "rank trains; its own error says why (every node must be started with the same "
                "--batch-sizes and --nproc)"
            )
        )
    first = rows[0]
    for rank, row in enumerate(rows):
        if row[2:] != first[2:]:
            raise _every_rank(
                EvendpError(
                    f"the ranks hold different batch plans: rank 0 (node {first[1]}) has "
                    f"{_said(first, world)}, rank {rank} (node {row[1]}) has "
                    f"{_said(row, world)}; start every node with the same --batch-sizes (and "
                    "--nproc), one size per rank of the whole run, node 0's ranks first"
                )
            )
    assert plan is not None  # this rank's row was held
    return plan


def _every_rank(error: EvendpError) -> EvendpError:
    """``error``, marked as raised on every rank alike (a rank may end on it alone)."""
    error.every_rank = True
    return error


def _row(plan: BatchPlan | None, world: int) -> list[int]:
    """``[held?, node, sizes..., caps...]``: 2 + 2 * world ints, whatever the plan."""
    node = int(os.environ.get("GROUP_RANK", "0") or 0)
    if plan is None or len(plan.sizes) != world:
        return [_REFUSED, node] + [0] * (2 * world)
    caps = list(plan.caps) if plan.caps is not None else [_NO_CAP] * world
    return [_HELD, node, *plan.sizes, *caps]


def _canonical(options: Mapping[str, Any]) -> str:
    """The options as one text, the same on every rank for the same options."""
    return json.dumps(options, sort_keys=True, default=str)


def _options_differ(options: Mapping[str, Any], nodes: list[int], own: str) -> str:
    """The line naming the first rank (and node) whose options differ from rank 0's, and the
    first option that does."""
    every: list[Any] = [None] * len(nodes)
    dist.all_gather_object(every, _canonical(options))
    ours = json.loads(every[0])
    for rank, text in enumerate(every):
        theirs = json.loads(text)
        for key in sorted(set(ours) | set(theirs)):
            if ours.get(key) != theirs.get(key):
                flag = "--" + key.replace("_", "-")
                return (
                    f"node {nodes[rank]} was started with other options than node 0: {flag} is "
                    f"{theirs.get(key)!r} there (rank {rank}), {ours.get(key)!r} on node 0; start "
                    f"every machine with the same options but {own}"
                )
    return "the ranks were started with other options"  # pragma: no cover - digests differed


def _gather(row: list[int], world: int) -> list[list[int]]:
    mine = torch.tensor(row, dtype=torch.int64, device=comm_device())
    rows = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(rows, mine)
    return torch.stack(rows).tolist()


def _said(row: list[int], world: int) -> str:
    sizes, caps = row[2 : 2 + world], row[2 + world :]
    text = f"sizes {sizes}"
    return text if caps == [_NO_CAP] * world else f"{text} with caps {caps}"
