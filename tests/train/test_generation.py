"""`training.eval_generate` in process (the launch is tests/train/test_generation_launch.py): the prompts,
the end-of-turn token, generation that leaves training's random state and mode as they were (training
bit-identical with and without it), ZeRO-3's equal calls per rank, the records (generations.jsonl, the
MLflow table once per step), the export's generation_config and adapter base, validation, the report's
side-by-side rendering and the closing summary's answer line."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO_ROOT, fresh_store

from jobspec import rundir
from jobspec.spec.schema import fill_defaults
from jobspec.train import generation

TOKENIZER = REPO_ROOT / "jobs" / "data" / "tokenizer"
QWEN = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "vocab_size": 2048, "max_position_embeddings": 128, "attention_dropout": 0.3}
CHAT = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "red cat"},
                     {"role": "assistant", "content": "cat red"}, {"role": "user", "content": "sun moon"},
                     {"role": "assistant", "content": "moon sun"}]}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(TOKENIZER)


def job(tmp_path, **generate) -> dict:
    (tmp_path / "eval.jsonl").write_text(json.dumps(CHAT) + "\n" + json.dumps({"prompt": "a b", "completion": "b a"})
                                         + "\n")
    return fill_defaults({"name": "gen", "model": {"architecture": "qwen2", "task": "causal-lm", "config": QWEN},
                          "data": {"train": str(tmp_path / "eval.jsonl"), "eval": str(tmp_path / "eval.jsonl"),
                                   "tokenizer": str(TOKENIZER), "max_length": 64},
                          "training": {"max_steps": 2, "eval_generate": {"max_new_tokens": 6, **generate}}})


class Engine:
    """What the generator uses of a DeepSpeed engine."""

    def __init__(self, module):
        self.module, self.device = module, torch.device("cpu")

    def eval(self):
        self.module.eval()

    def train(self):
        self.module.train()


def model_of(spec, tokenizer):
    from jobspec.model.build import build_model
    torch.manual_seed(0)
    return build_model(spec, tokenizer)


def generator_of(spec, tokenizer, records, **kwargs):
    from jobspec.model.chat_turns import end_of_turn_ids
    prompts = generation.build_prompts(spec, tokenizer, tokenizer.chat_template, records)
    options = {"rank": 0, "world_size": 1, "batch_size": 2, "zero3": False, **kwargs}
    return generation.EvalGenerator(generation.settings(spec), spec["training"]["seed"], tokenizer, prompts,
                                    end_of_turn_ids(tokenizer, tokenizer.chat_template), **options)


def test_the_answer_ends_at_eos_or_the_templates_end_of_turn_token(tokenizer):
    from jobspec.model.chat_turns import end_of_turn_ids
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert end_of_turn_ids(tokenizer, tokenizer.chat_template) == [tokenizer.eos_token_id, eot]
    plain = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"   # no special token closes a turn
    assert end_of_turn_ids(tokenizer, plain) == [tokenizer.eos_token_id]
    assert end_of_turn_ids(tokenizer, None) == [tokenizer.eos_token_id]
    answer = generation.decode_answer(tokenizer, [*tokenizer(" cat red")["input_ids"], eot, 2, 2], [1, eot], 2)
    assert (answer.text, answer.stop_reason) == ("cat red", generation.STOP)
    ids = tokenizer(" on and on")["input_ids"]
    assert generation.decode_answer(tokenizer, ids, [1, eot], 2).stop_reason == generation.LENGTH


def test_prompts_are_the_turns_up_to_the_last_user_turn_rendered_as_the_model_is_prompted(tmp_path, tokenizer):
    spec = job(tmp_path)
    records = generation.source_records(spec)
    assert len(records) == 2   # prompts: 4 of an evaluation file of 2
    prompts = generation.build_prompts(spec, tokenizer, tokenizer.chat_template, records)
    assert prompts[0].reference == "moon sun" and prompts[1].reference == "b a"
    assert prompts[0].text == "system: Be brief.\nuser: red cat\nassistant: cat red\nuser: sun moon"
    # the columns a reviewer reads: the question first, the system prompt and earlier turns apart
    assert (prompts[0].user, prompts[0].system, prompts[0].context) == \
        ("sun moon", "Be brief.", "user: red cat\nassistant: cat red")
    assert (prompts[1].user, prompts[1].system, prompts[1].context) == ("a b", None, None)
    expected = tokenizer.apply_chat_template(CHAT["messages"][:4], add_generation_prompt=True, tokenize=False)
    assert prompts[0].ids == tokenizer(expected, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(prompts[0].ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    short = fill_defaults({**spec, "data": {**spec["data"], "max_length": 10}})
    kept = generation.build_prompts(short, tokenizer, tokenizer.chat_template, records)[0].ids
    assert kept == prompts[0].ids[-4:]   # max_length 10 - 6 new tokens: the prompt's last 4
    (tmp_path / "p.txt").write_text("first\n\nsecond\n")
    assert generation.file_records(tmp_path / "p.txt") == ["first", "second"]
    with pytest.raises(Exception, match="no user turn"):
        generation.build_prompts(spec, tokenizer, tokenizer.chat_template, [{"messages": []}])


def test_generation_leaves_training_bit_identical_and_answers_as_plain_generate(tmp_path, tokenizer):
    """Dropout on, sampling at temperature 1: steps with a generation between them equal steps without."""
    spec = job(tmp_path, temperature=1.0)
    records = generation.source_records(spec)

    def train(with_generation: bool):
        model = model_of(spec, tokenizer).train()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = generator_of(spec, tokenizer, records)
        ids = torch.tensor([generator.prompts[0].ids])
        torch.manual_seed(5)
        losses = []
        for step in range(4):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            if with_generation and step == 1:
                answers = generator.generate(Engine(model))
                assert model.training and set(answers) == {0, 1}
        return losses

    assert train(True) == train(False)


def test_batched_greedy_answers_equal_one_prompt_at_a_time(tmp_path, tokenizer):
    spec = job(tmp_path)
    model = model_of(spec, tokenizer)
    generator = generator_of(spec, tokenizer, generation.source_records(spec))
    answers = generator.generate(Engine(model))
    for index, prompt in enumerate(generator.prompts):
        ids = torch.tensor([prompt.ids])
        out = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                                    do_sample=False, eos_token_id=generator.end_ids, pad_token_id=2)
        assert answers[index].text == tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def test_under_zero3_every_rank_calls_generate_as_often(tmp_path, tokenizer):
    spec = job(tmp_path)
    records = ["one", "two", "three", "four", "five"]
    calls = {}
    for rank in range(3):
        generator = generator_of(spec, tokenizer, records, rank=rank, world_size=3, batch_size=1, zero3=True)
        calls[rank] = generator.shares()
    assert calls == {0: [[0], [3]], 1: [[1], [4]], 2: [[2], [-3]]}   # rank 2 repeats prompt 2, answer dropped
    plain = generator_of(spec, tokenizer, records, rank=2, world_size=3, batch_size=1, zero3=False)
    assert plain.shares() == [[2]]


class Sink:
    def __init__(self):
        self.metrics, self.tables = [], []

    def log(self, metrics, step):
        self.metrics.append((step, metrics))

    def log_table(self, step, rows):
        self.tables.append((step, rows))


def test_rank0_records_each_evaluation_once(tmp_path, tokenizer):
    from jobspec.train.progress import RunState
    spec = job(tmp_path)
    sink = Sink()
    generator = generator_of(spec, tokenizer, generation.source_records(spec), run_dir=tmp_path, sink=sink)
    answers = {0: generation.Answer("moon  sun", 3, "stop"), 1: generation.Answer("a b", 6, "length")}
    state = RunState(step=4)
    generator.record(state, generator.rows(4, answers), 1.5)
    generator.record(state, generator.rows(4, answers), 1.5)   # a resumed run evaluating step 4 again
    rows = rundir.read_generations(tmp_path)
    assert [(r["step"], r["index"], r["exact_match"]) for r in rows] == [(4, 0, True), (4, 1, False)]
    assert sink.metrics[0] == (4, {"time/eval_generate_s": 1.5, "eval/exact_match": 0.5})
    assert state.generation == {"step": 4, "prompt": rows[0]["prompt"], "reference": "moon sun",
                                "generation": "moon  sun", "stop_reason": "stop"}
    again = generator_of(spec, tokenizer, generation.source_records(spec), run_dir=tmp_path)
    assert again.recorded_steps == {4}


def test_the_mlflow_table_holds_each_step_once_question_first(tmp_path, empty_store):
    from mlflow import MlflowClient

    from jobspec.tracking import generations
    client = MlflowClient(fresh_store(empty_store, tmp_path / "mlflow.db"))
    run_id = client.create_run(client.create_experiment("g")).info.run_id
    rows = [{"step": 2, "index": 0, "prompt": "system: Be brief.\nuser: q", "user": "q", "system": "Be brief.",
             "context": None, "reference": "r", "generation": "g", "tokens": 3, "stop_reason": "stop",
             "exact_match": False}]
    shown = {k: v for k, v in rows[0].items() if k != "index"}   # the table's columns, and the prompt
    assert generations.log_table(client, run_id, 2, rows) is True
    assert generations.log_table(client, run_id, 2, rows) is False
    assert generations.read_table(client, run_id, 2) == [shown]
    rundir.append_generations(tmp_path, [{**rows[0], "step": 4}, {**rows[0], "step": 2}])
    assert generations.upload_missing(client, run_id, tmp_path) == 1   # step 4; step 2 is there
    assert generations.latest_table(client, run_id) == (4, [{**shown, "step": 4}])
    table = json.loads(Path(client.download_artifacts(run_id, "eval_generations.json", str(tmp_path)))
                       .read_text())
    assert table["columns"][:5] == ["step", "user", "reference", "generation", "system"]
    assert [row[:2] for row in table["data"]] == [[2, "q"], [4, "q"]]
    logged = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
    assert logged == [{"path": "eval_generations.json", "type": "table"}]   # what MLflow's UI lists


def test_a_run_with_one_table_per_evaluation_is_read_too(tmp_path, empty_store):
    from mlflow import MlflowClient

    from jobspec.tracking import generations
    client = MlflowClient(fresh_store(empty_store, tmp_path / "mlflow.db"))
    run_id = client.create_run(client.create_experiment("g")).info.run_id
    old = {"step": 6, "prompt": "p", "reference": "r", "generation": "g", "tokens": 3, "stop_reason": "stop",
           "exact_match": False}
    client.log_table(run_id, data={k: [v] for k, v in old.items()},
                     artifact_file="eval_generations/step_00000006.json")
    assert generations.table_steps(client, run_id) == [6]
    assert generations.latest_table(client, run_id) == (6, [old])
    assert generations.log_table(client, run_id, 6, [old]) is False


def test_the_run_description_links_to_the_generations_table(tmp_path, empty_store):
    from mlflow import MlflowClient

    from jobspec.launch.tracking import describe_run
    from jobspec.tracking.run import TrackedRun
    uri = fresh_store(empty_store, tmp_path / "mlflow.db")
    client = MlflowClient(uri)
    experiment = client.create_experiment("g")
    run_id = client.create_run(experiment).info.run_id
    tracked = TrackedRun(uri, experiment, run_id, client)
    describe_run(tracked, "A job.", "jobspec: g finished", generated=True)
    text = client.get_run(run_id).data.tags["mlflow.note.content"]
    link = f"(#/experiments/{experiment}/runs/{run_id}/artifacts/eval_generations.json)"
    assert text.startswith("A job.\n\n**Evaluation generations**: [eval_generations.json]" + link)
    assert text.endswith("```\njobspec: g finished\n```")
    describe_run(tracked, None, "jobspec: g finished", generated=False)
    assert "eval_generations" not in client.get_run(run_id).data.tags["mlflow.note.content"]


def test_the_exported_chat_model_stops_at_end_of_turn_and_the_adapter_names_its_base(tmp_path, tokenizer):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from jobspec.export.lora import BASE_DIR, write_adapter_dir
    from jobspec.export.hf_dir import ExportInfo, write_model_dir
    from jobspec.model.lora import apply_lora
    spec = job(tmp_path)
    spec["model"]["lora"] = fill_defaults({"model": {"lora": {"r": 2}}})["model"]["lora"]
    peft_model = apply_lora(model_of({**spec, "model": {**spec["model"], "lora": None}}, tokenizer), spec).eval()
    record = write_adapter_dir(tmp_path / "final-adapter", spec, peft_model, {"name": "final", "step": 2,
                                                                             "dtype": "fp32"}, tokenizer=tokenizer)
    base = tmp_path / "final-adapter" / BASE_DIR
    config = json.loads((tmp_path / "final-adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base) and record["path"] == str(tmp_path / "final-adapter")
    assert f'from_pretrained("{base}")' in (tmp_path / "final-adapter" / "README.md").read_text()
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "final-adapter").eval()
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, peft_model(input_ids=ids).logits)
    plain = {**spec, "model": {**spec["model"], "lora": None}}
    write_model_dir(tmp_path / "final", plain, model_of(plain, tokenizer).state_dict(),
                    ExportInfo("final", 2, "fp32", "test", {}, []), tokenizer=tokenizer)
    eos = json.loads((tmp_path / "final" / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|eot_id|>")]


@pytest.mark.parametrize("change, code", [
    ({"model": {"task": "masked-lm"}}, "eval-generate-task"),
    ({"data": {"eval": None}}, "eval-generate-no-eval"),
    ({"data": {"records": "text"}}, "eval-generate-text-records"),
    ({"training": {"eval_generate": {"prompts": "missing.jsonl"}}}, "eval-generate-prompts-file"),
    ({"training": {"eval_generate": {"max_new_tokens": 64}}}, "eval-generate-length"),
])
def test_validate_refuses_what_cannot_generate(tmp_path, capsys, change, code):
    from conftest import deep_merge

    from jobspec.cli import main
    (tmp_path / "eval.jsonl").write_text(json.dumps(CHAT) + "\n")
    raw = {"model": {"architecture": "qwen2", "task": "causal-lm", "config": QWEN},
           "data": {"train": "eval.jsonl", "eval": "eval.jsonl", "tokenizer": str(TOKENIZER), "max_length": 64},
           "training": {"max_steps": 2, "eval_generate": {"prompts": 2}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(deep_merge(raw, change)))
    assert main(["validate", str(tmp_path / "job.yaml"), "--format", "json"]) == 2
    codes = {error["code"] for error in json.loads(capsys.readouterr().out)["errors"]}
    assert code in codes


def test_the_report_puts_answers_side_by_side_and_the_summary_shows_the_first():
    from jobspec.launch import console
    from jobspec.report import generation_table as report
    from jobspec.rundir import RunSummary
    one = [{"prompt": "red cat", "reference": "cat red", "generation": "cat red"},
           {"prompt": "sun | moon", "reference": None, "generation": "moon\nsun"}]
    two = [{"prompt": "red cat", "reference": "cat red", "generation": "red red"}]
    comparison = report.compare([("lr=1e-3", 8, one), ("lr=1e-2", 6, two)])
    markdown = report.render_markdown(comparison).splitlines()
    assert markdown[0] == "| prompt | reference | lr=1e-3 (step 8) | lr=1e-2 (step 6) |"
    assert markdown[2] == "| red cat | cat red | cat red | red red |"
    assert markdown[3] == "| sun \\| moon | - | moon<br>sun | - |"
    text = report.render_text(comparison)
    assert "prompt 1: red cat\n  reference         cat red\n  lr=1e-3 (step 8)  cat red\n  lr=1e-2 (step 6)  red red" \
        in text
    assert "<td>sun | moon</td>" in report.render_html(comparison, "exp")
    summary = RunSummary(status="finished", generation={"step": 8, "prompt": "red cat", "generation": "cat\nred"})
    lines = console.closing_lines(summary, {}, job_name="j", run_dir="/r", checkpoint_dir="/c", exit_code=0)
    assert any(line.strip() == 'answer      step 8: "red cat" -> "cat red"' for line in lines)


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_zero3_lockstep_stops_every_row_together_and_answers_as_per_row_stopping(tmp_path, tokenizer, one_rank_group):
    """Under ZeRO-3 no rank idles while another generates (AllRanksEnded): the rows that ended keep
    going until all have, and the answers, cut at their first end token, are those of per-row stopping."""
    spec = job(tmp_path, max_new_tokens=12)
    records = ["red cat", "sun moon tree fish", "a", "hello there"]
    model = model_of(spec, tokenizer)
    per_row = generator_of(spec, tokenizer, records, world_size=2, batch_size=2, zero3=False)
    lockstep = generator_of(spec, tokenizer, records, world_size=2, batch_size=2, zero3=True)
    first = per_row.generate(Engine(model))
    # an end token the untrained model writes early in prompt 0's answer, so that one row stops first
    early = tokenizer(first[0].text, add_special_tokens=False)["input_ids"][2]
    per_row.end_ids = lockstep.end_ids = [*per_row.end_ids, early]
    expected, found = per_row.generate(Engine(model)), lockstep.generate(Engine(model))
    assert expected[0].stop_reason == generation.STOP and expected[2].stop_reason == generation.LENGTH
    assert {i: (a.text, a.tokens, a.stop_reason) for i, a in found.items()} == \
        {i: (a.text, a.tokens, a.stop_reason) for i, a in expected.items()}
