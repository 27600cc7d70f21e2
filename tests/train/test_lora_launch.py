"""LoRA on 2 CPU ranks through DeepSpeed's runner (two launches): ZeRO-3 with `export.adapter: both` and
ZeRO-0, the same tiny BERT token classifier (adapters on every linear layer, the head trained whole by
default). The loss goes down; the ZeRO-3 gather of the PEFT model gives the same merged model and the
same adapter as ZeRO-0 (where every rank holds the whole module); the merged directory loaded by
`from_pretrained` alone reproduces the engine's logits (the worker's JOBSPEC_EXPORT_REFERENCE hook);
summary.json counts the trainable parameters. Merged == base + adapter is tested in process
(test_lora_ranks.py)."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import TINY_SPEC, make_run_dir, read_metrics, run_worker
from fp_bounds import U32, adam_update_bound, forward_bound, gamma

pytestmark = pytest.mark.slow

STEPS, LR = 8, 1e-2
BERT, SEQ_LEN = TINY_SPEC["model"]["config"], TINY_SPEC["data"]["synthetic"]["seq_len"]
LORA = {"model": {"lora": {"r": 4, "alpha": 8, "dropout": 0.0}},
        "training": {"max_steps": STEPS, "optimizer": {"lr": LR}},
        "checkpoint": {"save_final": True}, "export": {"final": True, "adapter": "both"}}


@pytest.fixture(scope="module")
def base_checkpoint(tmp_path_factory):
    """The tiny BERT saved once, loaded by both runs: ZeRO-3 builds a model from a config under
    zero.Init, whose random initialisation differs from a whole model's, so equal exports need
    equal starting weights."""
    from conftest import TINY_SPEC
    from transformers import AutoConfig, AutoModelForTokenClassification
    model_spec = TINY_SPEC["model"]
    torch.manual_seed(0)
    config = AutoConfig.for_model("bert", num_labels=model_spec["num_labels"], **model_spec["config"])
    path = tmp_path_factory.mktemp("lora-base") / "bert"
    AutoModelForTokenClassification.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, base_checkpoint):
    out = {}
    for stage in (3, 0):
        root = tmp_path_factory.mktemp(f"lora-zero{stage}")
        model = {**LORA["model"], "name_or_path": str(base_checkpoint), "architecture": None}
        run_dir = make_run_dir(root, {**LORA, "model": model, "memory": {"zero_stage": stage}})
        done = run_worker(run_dir, env={"JOBSPEC_EXPORT_REFERENCE": str(root / "ref")}, timeout=400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        out[stage] = (run_dir, root)
    return out


def _tensors(directory) -> dict:
    from safetensors.torch import load_file
    files = sorted(directory.glob("*.safetensors"))
    assert files, f"no weights in {directory}"
    return {k: v for f in files for k, v in load_file(f).items()}


def test_zero3_loss_goes_down_and_counts_the_adapters(runs):
    run_dir, _ = runs[3]
    losses = [row["train/loss"] for row in read_metrics(run_dir) if "train/loss" in row]
    assert losses[-1] < losses[0], losses
    summary = json.loads((run_dir / "summary.json").read_text())
    counts = summary["parameters"]
    assert 0 < counts["trainable"] < counts["total"] / 4, counts
    assert {"final", "final-adapter"} <= set(summary["exports"])


def test_zero3_and_zero0_exports_are_equal(runs):
    exports = {stage: json.loads((run_dir / "summary.json").read_text())["exports"]
               for stage, (run_dir, _) in runs.items()}
    from pathlib import Path
    for name in ("final", "final-adapter"):
        zero3, zero0 = _tensors(Path(exports[3][name]["path"])), _tensors(Path(exports[0][name]["path"]))
        assert set(zero3) == set(zero0) and zero3
        for key in zero3:
            assert zero3[key].shape == zero0[key].shape, key
            diff = (zero3[key].float() - zero0[key].float()).abs()
            # ZeRO-3 reduce-scatters what ZeRO-0 all-reduces: per element, 8 AdamW steps can differ by at
            # most 2 * steps * 3.16 lr (opposite steps where g ~ 0) plus the weight's own rounding
            worst = 2 * STEPS * adam_update_bound(LR) + U32 * float(zero0[key].abs().max())
            assert float(diff.max()) <= worst, key
            # the tighter check that can see a bug: without a flip both runs take the same scale-invariant
            # steps up to a few roundings, ~1e-7 per element; the mean is held to 1e-5 (the old per-element
            # tolerance, so never tighter than before). An ungathered shard is off by the weights' scale
            # (BERT's init std 2e-2) and a stale step by up to lr = 1e-2 per trained element
            assert float(diff.mean()) <= 1e-5, key
    adapter = Path(exports[3]["final-adapter"]["path"])
    keys = set(_tensors(adapter))
    assert any("lora_A" in k for k in keys) and any("classifier" in k for k in keys)   # the head: modules_to_save
    assert all(t.abs().sum() > 0 for k, t in _tensors(adapter).items() if "lora_B" in k)   # trained, not empty


def test_the_merged_zero3_export_reproduces_the_engine(runs):
    from pathlib import Path

    from transformers import AutoModelForTokenClassification

    run_dir, root = runs[3]
    ref = torch.load(root / "ref" / "final.pt")
    path = Path(json.loads((run_dir / "summary.json").read_text())["exports"]["final"]["path"])
    model = AutoModelForTokenClassification.from_pretrained(path).eval()
    with torch.no_grad():
        logits = model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"]).logits
    # the same fp32 weights (ZeRO-3's gather copies them) through PEFT's adapter path vs merged W + s BA:
    # the forward bound of this BERT (2.1e-4 of the logits' scale, floored at 1: the classifier reads
    # LayerNorm outputs of size ~1; was atol 1e-4). A missing merge is off by the adapter's share, ~1e-1
    bound = forward_bound(BERT, SEQ_LEN) * max(1.0, float(ref["logits"].abs().max()))
    assert float((logits - ref["logits"]).abs().max()) <= bound, (logits - ref["logits"]).abs().max()


@pytest.mark.parametrize("stage", [3, 0])
def test_jobspec_export_of_the_final_checkpoint_equals_the_ranks_exports(runs, tmp_path, stage):
    """Offline, from the checkpoint (DeepSpeed's zero_to_fp32 for ZeRO-3: the adapters from the fp32
    masters, the frozen base from its saved fragments): the same merged model and adapter."""
    from pathlib import Path

    from jobspec.cli import main

    run_dir, _ = runs[stage]
    exports = json.loads((run_dir / "summary.json").read_text())["exports"]
    out = tmp_path / "offline"
    assert main(["export", str(run_dir), "--out", str(out)]) == 0
    # everything under --out: the merged model in it, the adapter in its adapter/
    assert sorted(p.name for p in tmp_path.iterdir()) == ["offline"]
    pairs = ((out, exports["final"]["path"]), (out / "adapter", exports["final-adapter"]["path"]))
    for mine, ranks in pairs:
        offline, live = _tensors(mine), _tensors(Path(ranks))
        assert set(offline) == set(live)
        for key in live:
            # the same fp32 values copied (masters, saved fragments) except the merge W + s BA, done by the
            # same PEFT code in another process: r + 2 roundings, gamma(6) |W| ~ 4e-7 at |W| <= 1. Kept at
            # the old 1e-5 (25x that): this slow test could not be re-run to confirm the live gather copies
            # the masters bit for bit. A stale checkpoint differs by up to 3.16 lr = 3e-2
            worst = max(1e-5, gamma(LORA["model"]["lora"]["r"] + 2) * float(live[key].abs().max()))
            assert float((offline[key].float() - live[key].float()).abs().max()) <= worst, key


def test_a_lora_zero2_checkpoint_resumes_on_another_world_size(tmp_path):
    """The step-3 checkpoint of an uninterrupted 2-rank run, resumed on 1 rank through DeepSpeed's
    universal checkpoint (checkpoint/reshard.py): the adapters and their optimizer states come back, the
    frozen base is rebuilt from the seed, and the losses of steps 4-6 match that run's (dropout off, the
    same global batch). Two launches: the run that saved step 3 is also the reference (a stopped run's
    checkpoint is the same save; test_reshard.py resumes one, without LoRA)."""
    import math
    import shutil

    from jobspec.checkpoint import save_load

    spec = {**LORA, "training": {"max_steps": 6, "global_batch_size": 8, "optimizer": {"lr": 1e-2}},
            "memory": {"zero_stage": 2}, "export": {"final": False},
            "checkpoint": {"every_n_steps": 3, "keep_last": 3},
            "model": {"lora": LORA["model"]["lora"],
                      "config": {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}}
    straight = make_run_dir(tmp_path / "a", spec)
    assert run_worker(straight, num_ranks=2).returncode == 0
    # the requeue sees only step 3, as if the 2 ranks had stopped there
    ckpt = tmp_path / "b" / "out" / "checkpoints"
    shutil.copytree(tmp_path / "a" / "out" / "checkpoints" / "step3", ckpt / "step3")
    save_load.publish_latest(ckpt, "step3")
    second = make_run_dir(tmp_path / "b", {**spec, "resources": {"gpus_per_node": 1}}, name="second")
    done = run_worker(second, num_ranks=1)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "resuming step 3 from world size 2 on 1 via universal checkpoint" in done.stdout
    summary = json.loads((second / "summary.json").read_text())
    assert (summary["status"], summary["steps"]) == ("finished", 6)
    expected = {r["step"]: r["train/loss"] for r in read_metrics(straight) if "train/loss" in r}
    got = {r["step"]: r["train/loss"] for r in read_metrics(second) if "train/loss" in r}
    assert sorted(got) == [4, 5, 6]
    # step 4 sees bit-identical weights (the universal checkpoint copies the fp32 masters) and the same 8
    # samples: only the forward's and the token mean's order differ, 2 * 2.1e-4 * max|logit| worst case,
    # ~1e-6 typical. Steps 5-6 also carry the updates, which 2 ranks and 1 rank x 2 micro-batches reduce in
    # another order; Adam can amplify that near g ~ 0 and the loss has no first-principles bound from it.
    # 1e-3 (unchanged, it has passed) stays for all three. Not measured here: how far a real bug (Adam's
    # moments not restored, the schedule restarted, another batch) moves them; each changes every weight by
    # O(lr) = 1e-2, not by rounding
    for step, loss in got.items():
        assert math.isfinite(loss) and abs(loss - expected[step]) < 1e-3, (step, loss, expected[step])
