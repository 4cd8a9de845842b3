"""``UnevenTrainer`` on 2 gloo ranks with sizes [1, 3] against one plain ``Trainer`` process.

One spawn runs both losses (token-level causal LM with padding and -100 labels; sample-level
sequence classification); the single-process references run here, in the test process, with
the whole optimizer-step batch (8 samples) in one forward pass.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._helpers import run_ranks, tiny_gpt2_config, torchrun_env
from tests.integrations._trl_script import pad_pairs  # the Marian pairs TRL's T5 case pads too

pytestmark = pytest.mark.multiprocess
transformers = pytest.importorskip("transformers")

SIZES = [1, 3]
ACCUM = 2
STEPS = 3
SAMPLES = sum(SIZES) * ACCUM * STEPS  # exactly the 3 optimizer steps: one epoch
TOL = 1e-5


# Models with no accepts_loss_kwargs flag (the probe decides), with empty shares: 17 samples make
# micro-steps 4, 4, 4, 4, 1 whose last is [0, 1]; [0, 4] gives rank 0 nothing at every step.
# task -> (model, sizes, samples)
EDGES = {
    "lm17": ("gpt2-lm", [1, 3], 17),
    "gpt2cls0": ("gpt2-cls", [0, 4], SAMPLES),
    "bertcls17": ("bert-cls", [1, 3], 17),
    "berttok0": ("bert-tok", [0, 4], SAMPLES),
}


def _samples() -> list[dict[str, Any]]:
    """Variable-length token sequences (ids 1..63; 0 is padding) with a class label each."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 13, (SAMPLES,), generator=g).tolist()
    return [
        {
            "input_ids": torch.randint(1, 64, (n,), generator=g),
            "class": int(torch.randint(0, 3, (), generator=g)),
        }
        for n in lengths
    ]


class _Data(torch.utils.data.Dataset):
    def __init__(self, task: str, samples: int = SAMPLES) -> None:
        self.task, self.items = task, _samples()[:samples]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        item = self.items[i]
        if self.task in ("lm", "gpt2-lm", "lm-mean"):
            label = item["input_ids"]
        elif self.task == "bert-tok":  # a tag per token, padding -100 (pad_collate)
            label = item["input_ids"] % 3
        else:
            label = torch.tensor(item["class"])
        return {"input_ids": item["input_ids"], "labels": label}


def _predict_and_evaluate(trainer: Any, data: Any) -> dict[str, Any]:
    """What the evaluation tests compare with one process: both losses, the predictions."""
    output = trainer.predict(data)
    return {
        "eval_loss": trainer.evaluate()["eval_loss"],
        "test_loss": output.metrics["test_loss"],
        "predictions": torch.as_tensor(output.predictions),
        "labels": torch.as_tensor(output.label_ids),
    }


def pad_collate(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest sample: ids 0, attention 0, LM labels -100."""
    longest = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, f in enumerate(features):
        ids[row, : len(f["input_ids"])] = f["input_ids"]
        mask[row, : len(f["input_ids"])] = 1
    if features[0]["labels"].dim() == 0:  # one class per sample
        labels = torch.stack([f["labels"] for f in features])
    else:  # one label per token
        labels = torch.full_like(ids, -100)
        for row, f in enumerate(features):
            labels[row, : len(f["labels"])] = f["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _model(task: str) -> torch.nn.Module:
    config = tiny_gpt2_config(num_labels=3, pad_token_id=0)
    torch.manual_seed(0)
    if task.startswith("bert"):
        bert = transformers.BertConfig(
            vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=32, max_position_embeddings=32, num_labels=3, pad_token_id=0,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        if task == "bert-tok":
            return transformers.BertForTokenClassification(bert)
        return transformers.BertForSequenceClassification(bert)
    if task == "gpt2-lm":
        return transformers.GPT2LMHeadModel(config)
    if task == "gpt2-cls":  # no flag: UnevenTrainer finds out its loss ignores the count
        return transformers.GPT2ForSequenceClassification(config)
    if task == "lm":
        return transformers.GPT2LMHeadModel(config)
    if task == "lm-mean":  # declared a per-batch mean: weighted by its shifted labels' count
        lm = transformers.GPT2LMHeadModel(config)
        lm.accepts_loss_kwargs = False
        return lm
    model = transformers.GPT2ForSequenceClassification(config)
    # Its forward takes **kwargs but its loss is a per-batch mean: the Trainer's own switch.
    model.accepts_loss_kwargs = False
    return model


def _args(out: str, batch: int, accum: int, **extra: Any) -> Any:
    options: dict[str, Any] = {
        "output_dir": out,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": accum,
        "max_steps": STEPS,
        "learning_rate": 0.5,
        "optim": "sgd",
        "lr_scheduler_type": "constant",
        "weight_decay": 0.0,
        "max_grad_norm": 0.0,
        "train_sampling_strategy": "sequential",
        "report_to": "none",
        "save_strategy": "no",
        "logging_strategy": "no",
        "disable_tqdm": True,
        "use_cpu": True,
        "seed": 0,
    }
    return transformers.TrainingArguments(**{**options, **extra})


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _worker(rank: int, port: int, out: str) -> None:
    torchrun_env(rank, 2, port)
    from evendp.integrations.transformers import UnevenTrainer

    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for task in ("lm", "lm-mean", "cls"):
            args = _args(tmp, batch=2, accum=ACCUM, ddp_backend="gloo")
            model = _model(task)
            trainer = UnevenTrainer(
                model, args, train_dataset=_Data(task), data_collator=pad_collate,
                batch_sizes=SIZES,
            )  # fmt: skip
            seen: list[list[int]] = []
            loader = trainer.get_train_dataloader()
            for batch in loader:  # the rows this rank gets, by their lengths
                seen.append(batch["attention_mask"].sum(dim=1).tolist())
            output = trainer.train()
            result[task] = {
                "params": _params(model),
                "world": args.world_size,
                "global_step": output.global_step,
                "total_batch": trainer.get_total_train_batch_size(args),
                "samples_per_second": output.metrics["train_samples_per_second"],
                "runtime": output.metrics["train_runtime"],
                "rows": seen,
            }
        for task, (name, sizes, samples) in EDGES.items():
            result[task] = _edge_run(tmp, name, sizes, samples)
        result["schedule"] = _schedule_run(UnevenTrainer, tmp, batch_sizes=SIZES)
        for task, (name, sizes) in EVALS.items():
            result[task] = _evaluations(UnevenTrainer, tmp, name, EVAL_BATCH, batch_sizes=sizes)
        for task, sizes in SEQ2SEQ.items():
            result[task] = _seq2seq_evaluations(tmp, batch_sizes=sizes)
    torch.save(result, Path(out) / f"rank{rank}.pt")
    import evendp

    evendp.finish_distributed()


# One epoch, losses logged every 2 steps: the last (third) step is not logged.
_EDGE_ARGS = {
    "max_steps": -1,
    "num_train_epochs": 1,
    "logging_strategy": "steps",
    "logging_steps": 2,
}


def _edge_run(tmp: str, name: str, sizes: list[int], samples: int) -> dict[str, Any]:
    from evendp.integrations.transformers import UnevenTrainer

    args = _args(tmp, batch=2, accum=ACCUM, ddp_backend="gloo", **_EDGE_ARGS)
    model = _model(name)
    trainer = UnevenTrainer(
        model, args, train_dataset=_Data(name, samples), data_collator=pad_collate,
        batch_sizes=sizes,
    )  # fmt: skip
    output = trainer.train()
    return {
        "params": _params(model),
        "train_loss": output.training_loss,
        "metrics_loss": output.metrics["train_loss"],
        "logged": [e["loss"] for e in trainer.state.log_history if "loss" in e],
        "global_step": output.global_step,
    }


# A warm-up then linear decay over 2 epochs of 17 samples (3 steps each, the last of 1
# sample): the step count the Trainer derives from the loader's length (issue 36).
_SCHEDULE_ARGS = {
    "max_steps": -1, "num_train_epochs": 2, "lr_scheduler_type": "linear", "warmup_steps": 2,
    "logging_strategy": "steps", "logging_steps": 1,
}  # fmt: skip


def _schedule_run(trainer_class: Any, tmp: str, **options: Any) -> list[float]:
    """The learning rate of every optimizer step, as the Trainer logs it."""
    ranks = {"ddp_backend": "gloo"} if trainer_class is not transformers.Trainer else {}
    batch, accum = (2, ACCUM) if ranks else (sum(SIZES) * ACCUM, 1)
    args = _args(tmp, batch=batch, accum=accum, **_SCHEDULE_ARGS, **ranks)
    trainer = trainer_class(
        _model("lm"), args, train_dataset=_Data("lm", 17), data_collator=pad_collate, **options
    )
    trainer.train()
    return [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]


def test_the_learning_rate_of_every_step_is_one_processs(ranks: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        want = _schedule_run(transformers.Trainer, tmp)
    assert len(want) == 6  # 2 epochs of 3 steps
    for rank in ranks:
        assert rank["schedule"] == pytest.approx(want, rel=1e-12)


# Evaluation (issue 36): 13 rows, 3 a rank -> batches of 6, 6 and 1 rows over both ranks;
# [0, 4]: rank 0 evaluates a stand-in row only. task -> (model, sizes)
EVAL_ROWS, EVAL_BATCH = 13, 3
EVALS = {
    "eval-lm": ("gpt2-lm", [1, 3]),
    "eval-lm0": ("gpt2-lm", [0, 4]),
    "eval-bert": ("bert-cls", [1, 3]),
}


def _evaluations(trainer_class: Any, tmp: str, name: str, batch: int, **options: Any) -> dict:
    """``evaluate()`` and ``predict()`` of an untrained model on EVAL_ROWS rows, batches of
    ``batch`` rows (over all ranks: one process's batches)."""
    ranks = {"ddp_backend": "gloo"} if trainer_class is not transformers.Trainer else {}
    args = _args(tmp, batch=2, accum=1, per_device_eval_batch_size=batch, **ranks)
    data = _Data(name, EVAL_ROWS)
    trainer = trainer_class(
        _model(name), args, eval_dataset=data, data_collator=pad_collate, **options
    )
    return _predict_and_evaluate(trainer, data)


def _reference(
    task: str, samples: int = SAMPLES, **extra: Any
) -> tuple[dict[str, torch.Tensor], Any]:
    """One plain Trainer process, the whole step's 8 samples in one forward pass."""
    model = _model(task)
    with tempfile.TemporaryDirectory() as tmp:
        args = _args(tmp, batch=sum(SIZES) * ACCUM, accum=1, **extra)
        trainer = transformers.Trainer(
            model, args, train_dataset=_Data(task, samples), data_collator=pad_collate
        )
        output = trainer.train()
    return _params(model), (output, trainer.state.log_history)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_worker, 2, tmp_path_factory.mktemp("hf"), 300, "UnevenTrainer ranks")


def _relative_update_error(got: dict, want: dict, start: dict) -> float:
    num = sum(float((got[k] - want[k]).norm() ** 2) for k in want) ** 0.5
    den = sum(float((want[k] - start[k]).norm() ** 2) for k in want) ** 0.5
    return num / den


@pytest.mark.parametrize("task", ["lm", "lm-mean", "cls"])
def test_parameters_equal_one_process_on_the_whole_batch(
    ranks: list[dict[str, Any]], task: str
) -> None:
    start = _params(_model(task))
    want, _ = _reference(task)
    for rank in ranks:
        assert rank[task]["world"] == 2
        assert rank[task]["global_step"] == STEPS
        # The update itself (not just the parameters) matches to fp32 round-off.
        assert _relative_update_error(rank[task]["params"], want, start) < TOL


def test_each_rank_takes_its_own_batch_size_and_every_sample_once(
    ranks: list[dict[str, Any]],
) -> None:
    lengths = sorted(len(s["input_ids"]) for s in _samples())
    for task in ("lm", "cls"):
        rows = [r[task]["rows"] for r in ranks]
        assert [len(r) for r in rows] == [STEPS * ACCUM] * 2  # the same number of steps
        assert all(len(batch) == SIZES[rank] for rank in (0, 1) for batch in rows[rank])
        assert sorted(n for r in rows for batch in r for n in batch) == lengths


def test_reported_total_batch_and_throughput_are_true(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        metrics = rank["lm"]
        assert metrics["total_batch"] == sum(SIZES) * ACCUM
        samples = metrics["samples_per_second"] * metrics["runtime"]
        assert samples == pytest.approx(SAMPLES, rel=0.05)  # rounded metrics


@pytest.mark.parametrize("task", list(EDGES))
def test_any_model_and_empty_shares_equal_one_process_and_report_global_losses(
    ranks: list[dict[str, Any]], task: str
) -> None:
    """No accepts_loss_kwargs flag; an empty share (stand-in) on rank 0; the last step unlogged."""
    name, _, samples = EDGES[task]
    start = _params(_model(name))
    want, (output, history) = _reference(name, samples, **_EDGE_ARGS)
    logged = [e["loss"] for e in history if "loss" in e]
    for rank in ranks:
        got = rank[task]
        assert got["global_step"] == output.global_step == 3
        assert _relative_update_error(got["params"], want, start) < TOL
        # train_loss and the logged losses are the global batch's, on every rank
        assert got["train_loss"] == pytest.approx(output.training_loss, rel=1e-5)
        assert got["metrics_loss"] == pytest.approx(output.training_loss, rel=1e-5)
        assert got["logged"] == pytest.approx(logged, rel=1e-5)


@pytest.mark.parametrize("task", list(EVALS))
def test_evaluate_and_predict_equal_one_process_each_row_once(
    ranks: list[dict[str, Any]], task: str
) -> None:
    """Issue 36: the Trainer's own sharding padded the last batch with repeated rows and
    averaged each rank's batch by itself (eval_loss 3.634771 against 3.629491)."""
    name, _ = EVALS[task]
    with tempfile.TemporaryDirectory() as tmp:  # one process, the same batches of 3 rows
        want = _evaluations(transformers.Trainer, tmp, name, EVAL_BATCH)
    counted = want["labels"] != -100  # logits past a row's end depend on its batch's padding
    if want["predictions"].dim() == 2:  # a class per row: every logit counts
        counted = torch.ones_like(want["predictions"], dtype=torch.bool)
    else:
        counted = counted.unsqueeze(-1).expand_as(want["predictions"])
    for rank in ranks:
        got = rank[task]
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5)
        assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-5)
        assert torch.equal(got["labels"], want["labels"])  # each row once, in order
        assert got["predictions"].shape == want["predictions"].shape
        torch.testing.assert_close(
            got["predictions"][counted], want["predictions"][counted], rtol=1e-5, atol=1e-5
        )


# Issue 51: Seq2SeqTrainer (run_translation.py's, predict_with_generate) with a tiny Marian; its
# loss is a mean over each batch's label tokens, whose count differs by row. task -> sizes
SEQ2SEQ = {"s2s": [1, 3], "s2s0": [0, 4]}


class _Pairs(torch.utils.data.Dataset):
    """EVAL_ROWS source/target pairs (ids 3..39), targets of 1 to 9 tokens."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(5)
        self.items = [
            {
                "input_ids": torch.randint(3, 40, (int(n),), generator=g),
                "labels": torch.randint(3, 40, (int(m),), generator=g),
            }
            for n, m in zip(
                torch.randint(2, 9, (EVAL_ROWS,), generator=g),
                torch.randint(1, 10, (EVAL_ROWS,), generator=g),
                strict=True,
            )
        ]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.items[i]


def _marian() -> Any:
    config = transformers.MarianConfig(
        vocab_size=40, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
        max_position_embeddings=32, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.5,
    )  # fmt: skip
    torch.manual_seed(0)  # init_std 0.5: confident, unequal token losses (untrained)
    return transformers.MarianMTModel(config)


def _seq2seq_evaluations(tmp: str, **options: Any) -> dict:
    """``evaluate()`` and ``predict()`` of ``class X(UnevenTrainer, Seq2SeqTrainer)`` (one
    process: the plain ``Seq2SeqTrainer``) with the same arguments: batches of 3 rows."""
    trainer_class: Any = transformers.Seq2SeqTrainer
    if options:
        from evendp.integrations.transformers import UnevenTrainer

        class UnevenSeq2SeqTrainer(UnevenTrainer, transformers.Seq2SeqTrainer):
            pass

        trainer_class, options = UnevenSeq2SeqTrainer, {**options, "ddp_backend": "gloo"}
    sizes = {"batch_sizes": options.pop("batch_sizes")} if "batch_sizes" in options else {}
    args = transformers.Seq2SeqTrainingArguments(
        tmp, per_device_eval_batch_size=EVAL_BATCH, predict_with_generate=True,
        generation_max_length=4, report_to="none", use_cpu=True, disable_tqdm=True, **options,
    )  # fmt: skip
    data = _Pairs()
    trainer = trainer_class(
        model=_marian(), args=args, eval_dataset=data, data_collator=pad_pairs, **sizes
    )
    return _predict_and_evaluate(trainer, data)


@pytest.mark.parametrize("task", list(SEQ2SEQ))
def test_seq2seq_evaluation_equals_the_same_script_in_one_process(
    ranks: list[dict[str, Any]], task: str
) -> None:
    """Issue 51: evaluation batches of ``per_device_eval_batch_size * world_size`` rows put
    rows 0-5 in one batch where one process has 0-2 and 3-5; a token mean's batch average then
    differs (eval_loss 3.7441 against 3.7413 here); ``[0, 4]``: rank 0 runs stand-ins only."""
    with tempfile.TemporaryDirectory() as tmp:
        want = _seq2seq_evaluations(tmp)
    for rank in ranks:
        got = rank[task]
        assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5, abs=0)
        assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-5, abs=0)
        # Each row once, in order, and its generated tokens. How a row is padded depends on
        # its batch's (here: its piece's) longest row: -100 to that, then 0 (Seq2SeqTrainer).
        assert _unpadded(got["labels"]) == _unpadded(want["labels"])
        assert _unpadded(got["predictions"]) == _unpadded(want["predictions"])


def _unpadded(rows: torch.Tensor) -> list[list[int]]:
    """Each row without its trailing padding (0 or -100; real ids are 3 to 39)."""
    out = []
    for row in rows.masked_fill(rows == -100, 0).tolist():
        while row and row[-1] == 0:
            row.pop()
        out.append(row)
    return out


def _trainer(tmp_path: Path, **options: Any) -> Any:
    from evendp.integrations.transformers import UnevenTrainer

    args = _args(str(tmp_path), batch=2, accum=1, **options.pop("args", {}))
    return UnevenTrainer(_model("lm"), args, train_dataset=_Data("lm"), **options)


def test_batch_sizes_default_to_the_launcher_then_to_per_device(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _trainer(tmp_path).batch_sizes == [2]  # per_device_train_batch_size, one process
    monkeypatch.setenv("EVENDP_BATCH_SIZES", "5")
    trainer = _trainer(tmp_path)
    assert trainer.batch_sizes == [5]
    assert trainer.get_total_train_batch_size(trainer.args) == 5


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"args": {"auto_find_batch_size": True}}, "auto_find_batch_size=True is not supported"),
        ({"args": {"average_tokens_across_devices": False}}, "average_tokens_across_devices"),
        ({"args": {"train_sampling_strategy": "group_by_length"}}, "'random' and 'sequential'"),
        ({"batch_sizes": [1, 3]}, r"2 batch sizes \[1, 3\] for world_size=1"),
        ({"batch_sizes": [0]}, "all batch sizes are zero"),
        (
            {"balance": "fast"},
            r"balance='fast' is not a balance; expected one of \('none', 'speed'\)",
        ),
    ],
)
def test_refuses_what_it_cannot_keep_exact(
    tmp_path: Path, options: dict[str, Any], message: str
) -> None:
    import evendp

    with pytest.raises(evendp.EvendpError, match=message):
        _trainer(tmp_path, **options)


class _OddLoss(torch.nn.Module):
    """A forward taking **kwargs whose loss depends on num_items_in_batch, but not as 1/count."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(64, 3)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> dict:
        loss = torch.nn.functional.cross_entropy(self.emb(input_ids)[:, 0], labels)
        count = kwargs.get("num_items_in_batch")
        return {"loss": loss if count is None else loss / count.float().sqrt()}


def test_a_loss_that_uses_the_count_oddly_stops_at_the_first_step(tmp_path: Path) -> None:
    import evendp
    from evendp.integrations.transformers import UnevenTrainer

    args = _args(str(tmp_path), batch=2, accum=1)
    trainer = UnevenTrainer(_OddLoss(), args, train_dataset=_Data("cls"), data_collator=pad_collate)
    with pytest.raises(evendp.EvendpError, match=r"model\.accepts_loss_kwargs"):
        trainer.train()
