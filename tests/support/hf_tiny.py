"""Support for tests/test_hf.py and tests/support/hf_ddp.py (not a test module): a tiny
BERT built from a config (no download), a padded text set as a Hugging Face ``datasets.Dataset``
with a column the model does not take, and Trainers that record what they computed."""

from __future__ import annotations

import random
from typing import Any

import torch


def text_set(n: int, seed: int) -> Any:
    """``n`` rows of token ids of varying length (4 to 15), a label, and an ``extra`` column
    that the Trainer's column removal must drop."""
    import datasets

    rng = random.Random(seed)
    ids = [[rng.randrange(5, 60) for _ in range(rng.randrange(4, 16))] for _ in range(n)]
    return datasets.Dataset.from_dict({
        "input_ids": ids, "labels": [int(sum(row) % 2) for row in ids],
        "extra": [f"row {i}" for i in range(n)],
    })


def pad(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The collator: pads ``input_ids`` to the batch's longest row, with an attention mask."""
    longest = max(len(row["input_ids"]) for row in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for r, row in enumerate(rows):
        ids[r, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[r, : len(row["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask,
            "labels": torch.tensor([row["labels"] for row in rows])}


def tiny_bert() -> Any:
    import transformers

    config = transformers.BertConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=32, max_position_embeddings=32, num_labels=2)
    return transformers.BertForSequenceClassification(config)


def accuracy(prediction: Any) -> dict[str, float]:
    logits, labels = prediction.predictions, prediction.label_ids
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def recording(base: type) -> type:
    """``base`` (a Trainer class) recording each training step's loss (exact, not the logged
    rounding) and the rows of each training batch (each row's token ids, padding dropped)."""

    class Recording(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.losses: list[float] = []
            self.rows: list[list[list[int]]] = []
            self.resumed_loader: Any = None
            self.eval_loaders: list[Any] = []
            self.train_loaders: list[Any] = []

        def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if model.training:
                self.losses.append(float((loss[0] if isinstance(loss, tuple) else loss).item()))
                self.rows.append([[int(t) for t in row if t] for row in inputs["input_ids"]])
            return loss

        def get_train_dataloader(self) -> Any:
            self.train_loaders.append(super().get_train_dataloader())
            return self.train_loaders[-1]

        def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
            self.eval_loaders.append(super().get_eval_dataloader(eval_dataset))
            return self.eval_loaders[-1]

        def get_test_dataloader(self, test_dataset: Any) -> Any:
            self.eval_loaders.append(super().get_test_dataloader(test_dataset))
            return self.eval_loaders[-1]

        def get_resumed_dataloader(self, dataloader: Any, num_batches: int) -> Any:
            self.resumed_loader = super().get_resumed_dataloader(dataloader, num_batches)
            return self.resumed_loader

    return Recording


def trainer(kind: type, out: str, train: Any, evaluation: Any = None, **arguments: Any) -> Any:
    """A recording ``kind`` Trainer on a fresh tiny BERT (seeded as the Trainer seeds it)."""
    import transformers

    extra = {"gpufeed_options": arguments.pop("gpufeed_options")} if (
        "gpufeed_options" in arguments) else {}
    transformers.set_seed(42)
    settings: dict[str, Any] = dict(
        output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=8,
        learning_rate=1e-3, seed=42, report_to=[], use_cpu=True, disable_tqdm=True,
        logging_strategy="no", save_strategy="no")
    args = transformers.TrainingArguments(**{**settings, **arguments})
    return recording(kind)(model=tiny_bert(), args=args, train_dataset=train,
                           eval_dataset=evaluation, data_collator=pad,
                           compute_metrics=accuracy, **extra)
