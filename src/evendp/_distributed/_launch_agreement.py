"""Under ``evendp launch`` on several machines: every rank holds one plan and one set of run
options, or every machine stops, as under ``evendp train`` (issue 51).

A user's script starts the process group itself, so the wrapper that runs it
(:mod:`._first_step`) wraps ``torch.distributed.init_process_group``: right after it returns,
the ranks run :func:`~evendp._distributed._plan_agreement.agreed_plan` on the plan
(``EVENDP_BATCH_SIZES``) and the options every machine must share (:data:`ENV_LAUNCH_OPTIONS`).
On a difference every rank ends there, each machine's first rank saying it in one line.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .._core._errors import EvendpError

__all__ = ["ENV_LAUNCH_OPTIONS", "LAUNCH_OWN", "agree_when_the_group_starts", "end_on"]

#: Set by ``evendp launch --nnodes N`` (N > 1): the options every machine must share, as JSON.
ENV_LAUNCH_OPTIONS = "EVENDP_LAUNCH_OPTIONS"
#: What each machine may give its own, named in the error.
LAUNCH_OWN = "--node-rank, --nproc, --gpus, --min-free and the rendezvous address"


def agree_when_the_group_starts(watch: Any) -> None:
    """Have the ranks agree once the script's process group starts, when the launcher asked;
    ``watch(name, then)`` runs ``then(module)`` once module ``name`` is imported."""
    text = os.environ.get(ENV_LAUNCH_OPTIONS)
    if not text:
        return
    options = json.loads(text)  # the launcher's own JSON, through the ranks' environment
    if not isinstance(options, dict):
        return
    watch("torch.distributed", functools.partial(_wrap_init, options=options))


def _wrap_init(module: Any, *, options: Mapping[str, Any]) -> None:
    """``init_process_group`` (the package's and ``distributed_c10d``'s), then the agreement."""
    original = getattr(module, "init_process_group", None)
    if original is None or getattr(original, "_evendp_agrees", False):
        return

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        started = original(*args, **kwargs)
        _agree(options)
        return started

    init_process_group._evendp_agrees = True  # type: ignore[attr-defined]
    module.init_process_group = init_process_group
    c10d: Any = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None:
        c10d.init_process_group = init_process_group


def _agree(options: Mapping[str, Any]) -> None:
    import torch.distributed as dist

    from .._core._errors import EvendpError
    from ._batch_plan import BatchPlan
    from ._plan_agreement import agreed_plan

    world = dist.get_world_size()

    def plan() -> BatchPlan:
        held = BatchPlan.from_env(world)  # not a read by the script: no mark for the launcher
        if held is None:
            raise EvendpError("EVENDP_BATCH_SIZES is not set on this machine's ranks")
        return held

    try:
        agreed_plan(plan, world, options, own=LAUNCH_OWN)
    except EvendpError as exc:  # on every rank alike
        end_on(exc)


def end_on(error: EvendpError) -> None:
    """End this rank on ``error`` in one line, without a traceback (each machine's first rank
    says it and leaves the exit code for its launcher). Raised on every rank alike, exit 0
    (torchrun neither restarts nor reports); on this rank alone, exit 1, so that torchrun
    stops the ranks that would wait for it."""
    from ._launch_notes import write_outcome

    every = bool(error.every_rank)
    first = os.environ.get("LOCAL_RANK", "0") == "0"
    if first or not every:
        where = "" if every else f"rank {os.environ.get('RANK', '?')}: "
        print(f"evendp launch: error: {where}{error}", file=sys.stderr, flush=True)
        write_outcome(error.exit_code, message=str(error))
    sys.stdout.flush()
    os._exit(0 if every else 1)
