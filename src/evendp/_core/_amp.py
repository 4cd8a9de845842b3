"""Mixed precision's names, the one list: ``TrainConfig.amp``, ``--amp``, ``plan(amp=...)``
and the rehearsal read them here (no torch at import: the command line lists them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._errors import EvendpError

if TYPE_CHECKING:
    import torch

__all__ = ["AMP_MODES", "amp_dtype"]

#: ``none`` is fp32; the others autocast to that dtype.
AMP_MODES: tuple[str, ...] = ("none", "bf16", "fp16")


def amp_dtype(amp: torch.dtype | str | None) -> torch.dtype | None:
    """``amp`` as the autocast dtype: a dtype, ``None``, or one of :data:`AMP_MODES`.

    >>> import torch
    >>> amp_dtype("bf16"), amp_dtype(torch.float16), amp_dtype("none")
    (torch.bfloat16, torch.float16, None)
    """
    if not isinstance(amp, str):
        return amp
    if amp not in AMP_MODES:
        raise EvendpError(
            f"amp must be one of {list(AMP_MODES)} or a torch dtype, got {amp!r}; e.g. amp='bf16'"
        )
    import torch

    dtypes: dict[str, torch.dtype | None] = dict(
        zip(AMP_MODES, (None, torch.bfloat16, torch.float16), strict=True)
    )
    return dtypes[amp]
