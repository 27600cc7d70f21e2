"""jobspec trains what transformers' Trainer trains at equal settings.

A tiny BERT sequence classifier saved as a local checkpoint (its config with dropout 0.1, which both
sides override to 0) and its WordPiece tokenizer; 64 records of 2 to 18 words padded to 24 tokens,
with one micro-batch of long records cut to 24 (no padding: the ranks hand that batch no attention
mask, the Trainer an all-ones one). Both sides: samples in file order, micro-batch 4 x accumulation
2, fp32, torch's fused AdamW (weight decay 0.01 on matrices only), a linear schedule after a 2-step
warmup, gradient clipping that cuts some steps and not others, 6 steps. jobspec runs its worker's
training loop on one rank in this process (tests/train/split_runs.train_case); the Trainer is
bench/trainer_baseline.jobspec_like_trainer, whose loss is divided by the accumulation steps (BERT's
forward takes **kwargs, from which the Trainer concludes that its loss divides by the Trainer's item
count, and then divides by nothing: twice the gradient).

Every tensor's update must agree within 1% of the Trainer's own update (norms per tensor); measured,
they agree to about 1e-7. The key biases need the two runs' roundings alike: softmax ignores a shift
shared by a query's scores, so their gradient is zero in exact arithmetic and rounding noise in
fact, which Adam scales up to a step.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import split_runs
import torch
from spec_builder import BARE, build_spec

WORDS = ("the a cat dog sat ran on mat red blue big small fast slow bird fish tree house good bad "
         "very not and or").split()
RECORDS, MAX_LENGTH, STEPS, MICRO, ACCUMULATION = 64, 24, 6, 4, 2
LR, WARMUP, WEIGHT_DECAY, CLIPPING = 1e-3, 2, 0.01, 0.3
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def write_checkpoint(root: Path) -> Path:
    """A tiny BertForSequenceClassification and its tokenizer, saved as a local checkpoint."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    checkpoint = root / "tiny-bert"
    vocab = root / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    torch.manual_seed(0)
    config = BertConfig(vocab_size=5 + len(WORDS), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=64,
                        num_labels=2)
    BertForSequenceClassification(config).save_pretrained(checkpoint)
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(checkpoint)
    return checkpoint


def write_records(path: Path) -> list[dict]:
    """Records of different lengths; samples 8-11 (step 2's first micro-batch) cut to MAX_LENGTH."""
    rng = random.Random(5)
    records = []
    for i in range(RECORDS):
        words = 30 if 8 <= i < 12 else rng.randint(2, 18)
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        records.append({"text": text, "label": int(("cat" in text) ^ (words % 2))})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def trainer_run(checkpoint: Path, records: list[dict], attention: str,
                out: Path) -> tuple[dict, list, list]:
    """(final weights, per-step losses, per-step gradient norms) of transformers' Trainer."""
    import transformers
    from accelerate.state import AcceleratorState

    from bench.trainer_baseline import jobspec_like_trainer

    tokenizer = transformers.BertTokenizerFast.from_pretrained(checkpoint)
    encoded = tokenizer([r["text"] for r in records], truncation=True, max_length=MAX_LENGTH,
                        padding="max_length")
    rows = [{**{k: v[i] for k, v in encoded.items()}, "labels": r["label"]}
            for i, r in enumerate(records)]
    model = transformers.BertForSequenceClassification.from_pretrained(
        checkpoint, attn_implementation=attention, **NO_DROPOUT)
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=MICRO,
        gradient_accumulation_steps=ACCUMULATION, max_steps=STEPS, learning_rate=LR,
        weight_decay=WEIGHT_DECAY, max_grad_norm=CLIPPING, lr_scheduler_type="linear",
        warmup_steps=WARMUP, optim="adamw_torch_fused", seed=42, logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, use_cpu=True, dataloader_drop_last=True)
    environ = dict(os.environ)
    try:
        trainer = jobspec_like_trainer(model, args, rows, shuffle=False,
                                       data_collator=transformers.default_data_collator)
        assert trainer.loss_is_scaled_for_ga is False   # BERT's loss is its micro-batch's mean
        trainer.train()
    finally:   # accelerate keeps its state in the process and the environment
        AcceleratorState._reset_state(reset_partial_state=True)
        os.environ.clear()
        os.environ.update(environ)
    history = [row for row in trainer.state.log_history if "loss" in row]
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return weights, [row["loss"] for row in history], [row["grad_norm"] for row in history]


def jobspec_run(checkpoint: Path, train: Path, attention: str, root: Path) -> tuple[dict, list]:
    """(final weights, per-step train/loss) of the worker's training loop on one rank here."""
    from jobspec.compile.compiler import compile_spec
    from jobspec.rundir import RunFiles
    from jobspec.spec.derived import derive

    root.mkdir()
    spec = build_spec(BARE, directory=root, name="parity", output_dir=str(root / "out"),
                      model={"name_or_path": str(checkpoint), "task": "sequence-classification",
                             "attention": attention, "config": NO_DROPOUT},
                      data={"train": str(train), "max_length": MAX_LENGTH, "shuffle": False,
                            "num_workers": 0, "pin_memory": False},
                      training={"max_steps": STEPS, "micro_batch_size": MICRO,
                                "global_batch_size": MICRO * ACCUMULATION, "seed": 42,
                                "gradient_clipping": CLIPPING,
                                "optimizer": {"name": "adamw", "lr": LR,
                                              "weight_decay": WEIGHT_DECAY},
                                "scheduler": {"name": "linear", "warmup_steps": WARMUP}},
                      checkpoint={"save_final": False}, export={"final": False},
                      logging={"every_n_steps": 1, "mlflow": {"enabled": False},
                               "progress": "none"},
                      memory={"precision": "fp32", "zero_stage": 0},
                      resources={"gpus_per_node": 1})
    compiled = compile_spec(spec, derive(spec, num_train_samples=RECORDS))
    launch = {**compiled.plan.record(), "derived": compiled.derived.as_dict(), "notes": []}
    files = RunFiles(spec, compiled.ds_config, compiled.patches, launch)
    with split_runs.one_rank_process_group(root / "store"):
        weights, sink, _, engine = split_runs.train_case(files)
        engine.destroy()
    return weights, sink.metric("train/loss")


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_every_weight_follows_the_trainers_update(tmp_path, attention):
    from transformers import BertForSequenceClassification

    checkpoint = write_checkpoint(tmp_path)
    records = write_records(tmp_path / "train.jsonl")
    start = {n: p.detach().clone() for n, p in BertForSequenceClassification.from_pretrained(
        checkpoint).named_parameters()}
    theirs, their_losses, norms = trainer_run(checkpoint, records, attention, tmp_path / "trainer")
    ours, our_losses = jobspec_run(checkpoint, tmp_path / "train.jsonl", attention,
                                   tmp_path / "jobspec")

    assert min(norms) < CLIPPING < max(norms)   # clipping cuts some steps and leaves others
    assert our_losses == pytest.approx(their_losses, rel=1e-5)
    assert set(ours) == set(theirs) == set(start)
    off = {}
    for name, final in theirs.items():
        update = final - start[name]
        assert float(update.norm()) > 0, name   # every tensor trains
        off[name] = float((ours[name] - start[name] - update).norm() / update.norm())
    assert max(off.values()) <= 0.01, sorted(off.items(), key=lambda item: -item[1])[:5]
