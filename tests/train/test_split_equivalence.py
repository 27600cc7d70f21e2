"""The same job trains to the same weights however its global batch of 16 is split (issue 32).

Data whose micro-batches hold different numbers of labelled tokens: chat records with the loss on the
answers (a GPT-2), and masked LM (a BERT; 15% random masks). The 1-rank splits run in this process on a
one-rank gloo group (the worker's own build_engine and Trainer: tests/train/split_runs.py); the
2-rank splits (2 x 8, 2 x 2 x 4, at ZeRO 0 and 2, both tasks) in ONE real launch
(tests/train/split_ranks.py).

The bound. A split changes only the order in which each gradient element's terms are added: the
contributions of the global batch's token positions (P = 16 x sequence length), grouped by micro-batch
and rank, then accumulated; and each micro-batch's summed loss is the model's mean times its count (one
more rounding). Rounding errors of fp32 (unit roundoff u = 2^-24) in a sum of P terms grow like
sqrt(P) u of the terms' magnitude (Higham's probabilistic bound; the worst case P u is never reached
by random-signed roundings), per optimizer step, and a few steps of SGD add them up: so the weights of
two splits differ by at most ~ STEPS sqrt(P) u of a step's update; `bound` allows twice that. The
per-micro-batch mean this replaced differs by 1e-1 of the update (docs/loss.md).
"""
from __future__ import annotations

import math
import subprocess

import pytest
import split_runs
import torch
from conftest import free_port, worker_env
from split_runs import GLOBAL_BATCH, STEPS, run_files, train_case, worst_relative_difference

from jobspec.shm import remove_shared_memory_buffers

SEQUENCE = {"chat": 96, "mlm": 24}   # the padded length of a micro-batch, at most


def bound(task: str) -> float:
    """2 x STEPS x sqrt(P) x 2^-24, P the global batch's token positions (see the module docstring)."""
    return 2 * STEPS * math.sqrt(GLOBAL_BATCH * SEQUENCE[task]) * 2.0 ** -24


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    with split_runs.one_rank_process_group(tmp_path_factory.mktemp("pg") / "store"):
        yield


_results: dict = {}


def trained(task: str, micro: int, zero: int, **overrides) -> tuple[dict, list]:
    """(weights, logged train/loss) of 1 rank at this micro-batch (accumulation 16 / micro), once."""
    key = (task, micro, zero)
    if key not in _results:
        weights, sink, _, engine = train_case(run_files(task, world=1, micro=micro, zero=zero))
        engine.destroy()
        _results[key] = (weights, sink.metric("train/loss"))
    return _results[key]


def start(task: str) -> dict:
    if ("start", task) not in _results:
        _results[("start", task)] = split_runs.initial_weights(run_files(task, world=1, micro=16, zero=0))
    return _results[("start", task)]


@pytest.mark.parametrize("zero", [0, 2])
@pytest.mark.parametrize("task", ["chat", "mlm"])
def test_accumulation_on_one_rank_trains_what_one_micro_batch_trains(one_rank, task, zero):
    reference, reference_loss = trained(task, 16, zero)
    weights, loss = trained(task, 4, zero)
    assert worst_relative_difference(weights, reference, start(task)) < bound(task)
    assert loss == pytest.approx(reference_loss, rel=1e-6)   # train/loss: the step's token mean, either way
    if zero == 2:   # ZeRO 2 partitions the gradients and the update, not what they are
        assert worst_relative_difference(reference, trained(task, 16, 0)[0], start(task)) < bound(task)


@pytest.mark.parametrize("task", ["chat", "mlm"])
def test_train_loss_is_the_token_weighted_loss_of_the_global_batch(one_rank, task):
    """Step 1's logged loss against the model's cross-entropy computed here, over the first global
    batch's labelled tokens at once (float64, no jobspec code in the sum)."""
    import torch.nn.functional as F

    from jobspec.model.build import build_model, build_tokenizer
    from jobspec.data.loaders import PadCollator, build_datasets
    from jobspec.train.engine import seed_everything
    files = run_files(task, world=1, micro=4, zero=0)
    seed_everything(files.spec["training"]["seed"])
    tokenizer = build_tokenizer(files.spec)
    model = build_model(files.spec, tokenizer, files.ds_config).double()
    train_ds, _ = build_datasets(files.spec, tokenizer)
    batch = PadCollator(getattr(train_ds, "pad_token_id", 0) or 0)([train_ds[i] for i in range(GLOBAL_BATCH)])
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    if task == "chat":
        logits, labels = logits[:, :-1], labels[:, 1:]
    expected = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="mean")
    counts = [int((labels[i:i + 4] != -100).sum()) for i in range(0, GLOBAL_BATCH, 4)]
    assert len(set(counts)) > 1, "the micro-batches must differ in labelled tokens for this test to mean anything"
    assert trained(task, 4, 0)[1][0] == pytest.approx(float(expected), rel=1e-5)


def test_train_lr_is_the_rate_each_step_used(one_rank):
    """Linear warmup over 2 steps from 0: step 1 runs at 0 (no change), step 2 at lr/2, step 3 at lr."""
    files = run_files("mlm", world=1, micro=8, zero=0,
                      overrides={"training": {"scheduler": {"name": "linear", "warmup_steps": 2}}})
    weights, sink, _, engine = train_case(files, stop_after=1)
    engine.destroy()
    lr = files.spec["training"]["optimizer"]["lr"]
    assert sink.metric("train/lr") == [0.0]
    assert all(torch.equal(weights[n], w) for n, w in start("mlm").items())   # a step at rate 0 moves nothing
    _, sink, _, engine = train_case(files)
    engine.destroy()
    assert sink.metric("train/lr") == pytest.approx([0.0, lr / 2, lr])


def test_memory_fit_changing_the_split_keeps_the_trajectory(one_rank):
    """A split `memory.fit` chooses (its own candidate changes: a smaller micro-batch, with checkpointing)
    trains the weights the written one does."""
    from jobspec.memory.fit import apply_changes, candidate_changes
    from jobspec.spec.derived import derive
    files = run_files("chat", world=1, micro=16, zero=0)
    changes = next(c for c in candidate_changes(files.spec, derive(files.spec, num_train_samples=64), False)
                   if c.get("training.micro_batch_size") == 4 and c.get("memory.activation_checkpointing") is True
                   and len(c) <= 3)
    fitted = apply_changes(files.spec, changes)
    refit = run_files("chat", world=1, micro=fitted["training"]["micro_batch_size"], zero=0,
                      overrides={"memory": {"activation_checkpointing": True}})
    assert refit.launch["derived"]["gradient_accumulation_steps"] == 4
    assert any(p["name"] == "gradient_checkpointing" for p in refit.patches)
    weights, _, _, engine = train_case(refit)
    engine.destroy()
    assert worst_relative_difference(weights, trained("chat", 16, 0)[0], start("chat")) < bound("chat")


def test_a_resumed_run_keeps_the_trajectory(one_rank, tmp_path):
    """4 x 4 accumulation stopped after step 1 (a checkpoint) and resumed: the weights of the run that
    went through, and of one micro-batch of 16."""
    over = {"checkpoint": {"dir": str(tmp_path / "ckpt"), "save_final": False}}
    files = run_files("chat", world=1, micro=4, zero=0, overrides=over)
    _, _, state, engine = train_case(files, stop_after=1)
    engine.destroy()
    assert state.step == 1 and state.last_checkpoint
    weights, sink, state, engine = train_case(files, resume=True)
    engine.destroy()
    assert state.step == STEPS and len(sink.metric("train/loss")) == STEPS - 1
    assert all(torch.equal(weights[n], w) for n, w in trained("chat", 4, 0)[0].items())   # bit for bit
    assert sink.metric("train/loss") == trained("chat", 4, 0)[1][1:]


def test_oom_recovery_keeps_the_trajectory(one_rank, tmp_path):
    """An OOM in step 2 (4 x 4): the step is redone at 2 x 8 and the run ends where one micro-batch of 16 does."""
    from jobspec.train.oom import INJECT_AT_STEP_ENV
    files = run_files("chat", world=1, micro=4, zero=0, overrides={"training": {"on_oom": "halve_micro_batch"}})
    weights, sink, oom = split_runs.train_with_oom(files, tmp_path, {INJECT_AT_STEP_ENV: "2"})
    assert (oom.events, oom.micro, oom.accumulation) == (1, 2, 8)
    reference, reference_loss = trained("chat", 16, 0)
    assert worst_relative_difference(weights, reference, start("chat")) < bound("chat")
    assert sink.metric("train/loss") == pytest.approx(reference_loss, rel=1e-6)


@pytest.mark.slow
def test_two_ranks_train_what_one_rank_trains(one_rank, tmp_path):
    """2 x 8 and 2 x 2 x 4, chat and masked LM, ZeRO 0 and 2: one launch (tests/train/split_ranks.py)."""
    port = free_port()
    argv = ["deepspeed", "--num_gpus", "2", "--master_port", str(port),
            str(split_runs.REPO_ROOT / "tests" / "train" / "split_ranks.py"), str(tmp_path)]
    try:
        proc = subprocess.run(argv, cwd=tmp_path, env=worker_env({"JOBSPEC_PROGRESS": "none"}),
                              capture_output=True, text=True, timeout=900)
    finally:
        remove_shared_memory_buffers(str(port))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ranks = torch.load(tmp_path / "ranks.pt")
    for case, (weights, loss, _) in ranks.items():
        task, split, zero = case.split("-")
        reference, reference_loss = trained(task, 16, int(zero.removeprefix("zero")))
        assert worst_relative_difference(weights, reference, start(task)) < bound(task), case
        assert loss == pytest.approx(reference_loss, rel=1e-6), case


EVAL_SAMPLES = 41   # a multiple of no eval split's micro-batch x ranks (16, 4, 3, 2 x 4)
EVAL_SPLITS = [(16, 1), (4, 1), (3, 1), (4, 2)]   # (eval micro-batch, ranks)


def eval_bound(task: str) -> float:
    """How far eval/loss may lie from the float64 reference, relative. The splits differ only in how
    the fp32 per-token (per-sample) losses are grouped: a micro-batch's sum is the model's fp32 mean
    over its m labels times m (rounding ~ sqrt(m) u, Higham's probabilistic bound, plus one u), and
    the micro-batches are added in float64 (exact at this scale). Against float64 each loss also
    carries the fp32 forward's own rounding, a few u for these two-layer models on inputs of order one.
    With m at most the eval set's P label positions (41 x sequence length; 41 for sequence
    classification), 2 sqrt(P) u covers both. Measured: at most 7e-8 (docs/loss.md); the dropped
    tail was 3.5e-6 to 5.6e-4 off."""
    positions = EVAL_SAMPLES * (1 if task == "classify" else SEQUENCE[task])
    return 2 * math.sqrt(positions) * 2.0 ** -24


def eval_on_ranks(engine, dataset, counter_of, micro: int, world: int):
    """(eval/loss, metrics, forward passes per rank) of `evaluate` on `world` ranks of this process: the
    ranks run one after another, and rank 0's `all_reduce` adds the other ranks' vectors (a SUM
    all-reduce, as gloo's would), so rank 0 returns what every rank of a real launch returns."""
    import torch.distributed as dist

    from jobspec.data.loaders import make_loader
    from jobspec.train.evaluation import evaluate
    real_all_reduce, others = dist.all_reduce, []
    forwards = []
    for rank in reversed(range(world)):
        sent: list = []

        def all_reduce(tensor, *args, _sent=sent, _rank=rank, **kwargs):
            if _rank:
                _sent.append(tensor.clone())
            else:
                for vectors in others:
                    tensor += vectors[len(_sent)]
                _sent.append(None)
            return real_all_reduce(tensor, *args, **kwargs)
        loader = make_loader(dataset, micro_batch_size=micro, rank=rank, world_size=world, seed=0, epoch=0,
                             shuffle=False, num_workers=0, pin_memory=False)
        calls = [0]
        hook = engine.module.register_forward_pre_hook(lambda *_, calls=calls: calls.__setitem__(0, calls[0] + 1))
        dist.all_reduce = all_reduce
        try:
            loss, metrics = evaluate(engine, loader, counter_of())
        finally:
            dist.all_reduce = real_all_reduce
            hook.remove()
        forwards.append(calls[0])
        others.append(sent)
    return loss, metrics, forwards


@pytest.mark.parametrize("task", ["chat", "mlm", "classify"])
def test_eval_covers_every_sample_once_whatever_the_eval_micro_batch_and_ranks(one_rank, task):
    """eval/loss and the task metrics over the same 41 samples at eval micro-batches of 16, 4 and 3 and
    on 2 ranks x 4: one result, the one of every sample computed here in float64 -- the summed
    cross-entropy over every labelled token (the per-sample mean for sequence classification, with its
    accuracy), eval/perplexity its exp. 41 fills no split's micro-batch x ranks: the eval tail that was
    dropped (9, 1, 2 and 1 samples) is evaluated, in a short last batch, and the rank with fewer
    batches (rank 1 of 2: 20 samples in 5 batches, rank 0 21 in 6) runs a padding batch that counts
    nothing, so both ranks run the same number of (under ZeRO-3 collective) forward passes."""
    import torch.nn.functional as F

    from jobspec.data.loaders import PadCollator
    from jobspec.train.engine import build_engine
    from jobspec.train.task_metrics import counter_for
    classify = {"model": {"task": "sequence-classification", "num_labels": 3}}
    files = run_files("mlm" if task == "classify" else task, world=1, micro=16, zero=0,
                      overrides=classify if task == "classify" else None)
    engine, train_ds, _, _ = build_engine(files)
    subset = torch.utils.data.Subset(train_ds, range(EVAL_SAMPLES))
    subset.pad_token_id = getattr(train_ds, "pad_token_id", 0)
    results = {}
    for micro, world in EVAL_SPLITS:
        loss, metrics, forwards = eval_on_ranks(engine, subset, lambda: counter_for(files.spec, engine.module.config,
                                                                                    None), micro, world)
        assert len(set(forwards)) == 1, (micro, world, forwards)
        assert forwards[0] == -(-(-(-EVAL_SAMPLES // world)) // micro), (micro, world)
        results[micro, world] = loss, metrics
    batch = PadCollator(subset.pad_token_id or 0)([subset[i] for i in range(EVAL_SAMPLES)])
    with torch.no_grad():
        logits = engine.module.double()(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    engine.destroy()
    labels = batch["labels"]
    if task == "chat":
        logits, labels = logits[:, :-1], labels[:, 1:]
    expected = float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)))
    for split, (loss, metrics) in results.items():
        assert loss == pytest.approx(expected, rel=eval_bound(task)), split
        if task == "classify":   # counts: the same 41 samples on every split, exactly
            assert metrics["accuracy"] == float((logits.argmax(-1) == labels).sum()) / EVAL_SAMPLES, split
            assert metrics == results[16, 1][1], split
        else:
            assert metrics["perplexity"] == pytest.approx(math.exp(loss), rel=1e-12), split


def test_epochs_of_uneven_data_split_and_resume_alike(one_rank, tmp_path):
    """46 samples, reshuffled each epoch: a count that is a multiple of no split's micro-batch x ranks
    (4, 8 or 16 here). Each epoch trains its order's first 32 samples, 2 global batches, on every split
    (dropping each split's own incomplete micro-batch kept 44 samples at micro-batch 4 and 40 at 8, so
    from the second epoch on the splits trained different samples). After two epochs (4 steps), 4 x 4 and
    8 x 2 hold micro-batch 16's weights; runs stopped after step 2 (at the first epoch's end) and after
    step 3 (inside the second epoch) resume bit for bit."""
    def files(micro: int, name: str = "straight"):
        return run_files("mlm", world=1, micro=micro, zero=0, overrides={
            "data": {"synthetic": {"num_samples": 46}, "shuffle": True}, "training": {"max_steps": 4},
            "checkpoint": {"dir": str(tmp_path / name), "save_final": False}})
    reference, reference_sink, state, engine = train_case(files(16))
    engine.destroy()
    assert (state.epoch, state.batches_in_epoch) == (1, 2)   # two epochs of 2 micro-batches of 16
    straight, sink, state, engine = train_case(files(4))
    engine.destroy()
    assert (state.epoch, state.batches_in_epoch) == (1, 8)
    assert sink.metric("train/loss") == pytest.approx(reference_sink.metric("train/loss"), rel=1e-6)
    other, _, _, engine = train_case(files(8))
    engine.destroy()
    for weights in (straight, other):
        assert worst_relative_difference(weights, reference, start("mlm")) < bound("mlm") * 4 / STEPS
    for stop_after in (2, 3):
        run = files(4, f"stop{stop_after}")
        _, _, stopped, engine = train_case(run, stop_after=stop_after)
        engine.destroy()
        assert (stopped.epoch, stopped.batches_in_epoch) == ((0, 8) if stop_after == 2 else (1, 4))
        resumed, resumed_sink, _, engine = train_case(run, resume=True)
        engine.destroy()
        assert all(torch.equal(resumed[n], w) for n, w in straight.items()), stop_after
        assert resumed_sink.metric("train/loss") == sink.metric("train/loss")[stop_after:]
