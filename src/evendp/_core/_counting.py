"""What a mean loss is over: counting its items, and recognising the common cases.

Exactness needs every share's mean weighted by the items it is a mean over (see ``_exact``).
The samples are the default; a token loss with ``-100`` padding is a mean over its labels that
are not ignored, and a causal LM's loss skips label position 0 of every row (the shift). This
module holds the one count function users pass for that (:func:`count_tokens`), the rule that
recognises a Hugging Face model's without being told (:func:`label_shift`, :func:`auto_count`),
and the warning when neither applies and the inputs hold ignored labels.

A rule that changes how a step counts must be the same on every rank: it reads the model's
class and the batch's keys, never the values of one rank's batch.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from ._errors import EvendpError
from ._exact import is_stand_in

__all__ = [
    "IGNORE_INDEX",
    "TokenCount",
    "auto_count",
    "count_tokens",
    "holds_ignored",
    "label_shift",
    "uncounted_warning",
]

#: The label PyTorch's ``cross_entropy`` and Hugging Face's losses ignore by default.
IGNORE_INDEX = -100

_CAUSAL = re.compile(r"(ForCausalLM|LMHeadModel)$")
_UNSHIFTED = re.compile(
    r"For(MaskedLM|TokenClassification|SequenceClassification|MultipleChoice|"
    r"\w*Classification|QuestionAnswering|PreTraining)$"
)


class TokenCount:
    """A count function: the labels a mean loss is over (see :func:`count_tokens`)."""

    def __init__(self, *, shift: bool, ignore_index: int, key: str, keyed_only: bool) -> None:
        self.shift = shift
        self.ignore_index = ignore_index
        self.key = key
        # Automatic counts read labels by key only; anything else is counted by its rows.
        self._keyed_only = keyed_only

    def __repr__(self) -> str:
        extra = "" if self.ignore_index == IGNORE_INDEX else f", ignore_index={self.ignore_index}"
        extra += "" if self.key == "labels" else f", key={self.key!r}"
        return f"count_tokens(shift={self.shift}{extra})"

    def __call__(self, *args: Any, **kwargs: Any) -> int | torch.Tensor:
        labels = self._labels(args, kwargs)
        if labels is None:
            if self._keyed_only:
                return _rows(args, kwargs)
            raise EvendpError(
                f"{self!r} found no labels: no {self.key!r} among the keywords or in a dict "
                "batch, and no tensor among the positional arguments; pass key= (the name of "
                "the labels), or a count_fn of your own"
            )
        if is_stand_in(labels):
            return 0  # a stand-in sample (an empty share) counts nothing
        if labels.dim() == 0:
            return 1
        counted = labels[..., 1:] if self.shift and labels.dim() > 1 else labels
        if counted.is_floating_point():  # regression or multi-label targets: nothing ignored
            return torch.tensor(counted.numel())
        return counted.ne(self.ignore_index).sum()

    def _labels(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
        found = kwargs.get(self.key)
        if found is None:
            found = next(
                (a[self.key] for a in args if isinstance(a, Mapping) and self.key in a), None
            )
        if found is None and not self._keyed_only:
            # Positional: the targets of (inputs, targets), whether passed as two arguments
            # (ParallelCriterion, BalancedDataParallel) or as one tuple (the Trainer's batch).
            items = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list)) else args
            found = next((a for a in reversed(items) if isinstance(a, torch.Tensor)), None)
        return found if isinstance(found, torch.Tensor) else None


def count_tokens(
    *, shift: bool, ignore_index: int = IGNORE_INDEX, key: str = "labels"
) -> TokenCount:
    """A ``count_fn`` for a loss averaged over labels: those not ``ignore_index``.

    ``shift=True`` for a causal LM (Hugging Face ``*ForCausalLM``, GPT-2's ``LMHeadModel``):
    its loss compares position ``t`` with label ``t + 1``, so label position 0 of every row
    is never counted. ``shift=False`` for masked LM, token classification, seq2seq labels and
    one class per sample. There is no default: getting it wrong is the usual mistake.

    The same function fits every ``count_fn`` of evendp: the labels are ``key`` among the
    keywords or in a dict batch (``BalancedDataParallel(...)(**batch)``, the Trainer,
    ``UnevenTrainer``), else the last tensor of the positional arguments, the targets of
    ``(inputs, targets)`` (``ParallelCriterion``, ``StepMean.weigh(loss, targets)``). Float
    labels (regression, multi-label) count every element; a stand-in batch counts 0.

    >>> labels = torch.tensor([[5, 6, 7, -100], [8, 9, -100, -100]])
    >>> count_tokens(shift=False)(labels=labels), count_tokens(shift=True)(labels=labels)
    (tensor(5), tensor(3))
    >>> count_tokens(shift=True)({"input_ids": labels, "labels": labels})  # a dict batch
    tensor(3)
    >>> count_tokens(shift=False)(torch.zeros(2, 4, 9), labels)  # (output, targets)
    tensor(5)
    """
    if not isinstance(shift, bool):
        raise EvendpError(
            f"count_tokens(shift={shift!r}): shift must be True (a causal LM's labels, shifted "
            "by one) or False (labels compared where they stand)"
        )
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise EvendpError(f"count_tokens(ignore_index={ignore_index!r}) must be an int, e.g. -100")
    if not isinstance(key, str):
        raise EvendpError(f"count_tokens(key={key!r}) must be a string, e.g. 'labels'")
    return TokenCount(shift=shift, ignore_index=ignore_index, key=key, keyed_only=False)


def label_shift(model: Any) -> bool | None:
    """Whether a Hugging Face model's loss shifts its labels; ``None`` when not known.

    Read from the class name (as ``transformers`` picks its own loss) and, for generation
    models, ``config.is_encoder_decoder``; no import of ``transformers``. ``*ForCausalLM``,
    ``*LMHeadModel`` and decoder-only ``*ForConditionalGeneration`` shift; masked LM,
    classification, multiple choice and encoder-decoder generation do not.

    >>> class GPT2LMHeadModel(torch.nn.Module):
    ...     base_model_prefix, config = "transformer", object()
    >>> label_shift(GPT2LMHeadModel()), label_shift(torch.nn.Linear(2, 2))
    (True, None)
    """
    if not (hasattr(model, "config") and hasattr(type(model), "base_model_prefix")):
        return None
    name = type(model).__name__
    if _CAUSAL.search(name):
        return True
    if name.endswith("ForConditionalGeneration"):
        return not bool(getattr(model.config, "is_encoder_decoder", False))
    if _UNSHIFTED.search(name):
        return False
    return None


def auto_count(model: Any) -> TokenCount | None:
    """The count evendp uses when told none: labels by key for a recognised model, else
    ``None`` (the samples). It counts a batch without labels by its rows.

    >>> class BertForMaskedLM(torch.nn.Module):
    ...     base_model_prefix, config = "bert", object()
    >>> count = auto_count(BertForMaskedLM())
    >>> count(labels=torch.tensor([[1, -100], [2, 3]])), count(input_ids=torch.ones(3, 2))
    (tensor(3), 3)
    """
    shift = label_shift(model)
    if shift is None:
        return None
    return TokenCount(shift=shift, ignore_index=IGNORE_INDEX, key="labels", keyed_only=True)


def holds_ignored(obj: Any, ignore_index: int = IGNORE_INDEX) -> bool:
    """Whether an integer tensor in ``obj`` (nested) holds ``ignore_index``: padded labels.

    Reads values on the host: call it once, not every step.

    >>> holds_ignored({"labels": torch.tensor([1, -100])}), holds_ignored((torch.ones(2),))
    (True, False)
    """
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() or obj.is_complex() or obj.dtype == torch.bool:
            return False
        return bool((obj == ignore_index).any())
    values = obj.values() if isinstance(obj, Mapping) else obj
    if isinstance(values, (tuple, list)) or isinstance(obj, Mapping):
        return any(holds_ignored(v, ignore_index) for v in values)
    return False


def uncounted_warning(where: str, model: Any = None, *, stacklevel: int = 3) -> None:
    """Warn that a loss over labels with ``-100`` is weighted by samples, naming the fix."""
    shift = (
        "count_fn=evendp.count_tokens(shift=True) for a causal LM's labels (shift=False for "
        "labels compared where they stand: masked LM, token classification, seq2seq)"
    )
    name = "" if model is None else f" ({type(model).__name__})"
    warnings.warn(
        f"{where}{name}: the inputs hold labels of -100 (ignored) and the loss is a mean, but "
        "nothing says how many items each share's mean is over, so shares are weighted by "
        "their samples: not the result of one device on the whole batch. Pass "
        f"{shift}; or your own count_fn (return the samples to keep this weighting)",
        UserWarning,
        stacklevel=stacklevel + 1,
    )


def _rows(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """The rows of the first tensor with a batch dimension among the inputs (0 if none)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, (Mapping, tuple, list)):
            found = _rows(tuple(value.values() if isinstance(value, Mapping) else value), {})
            if found:
                return found
        elif isinstance(value, torch.Tensor) and value.dim() > 0:
            return 0 if is_stand_in(value) else int(value.shape[0])
    return 0
