"""`model.config` of every model type transformers registers is checked by validate (the generated
table), and the same refusal comes from plan, compile and launch --dry-run; a hub id's, which validate
cannot type, is checked by all three (job/model_config through job/checks) before anything is derived."""
from __future__ import annotations

import json
import textwrap

from jobspec.cli import main

T5_JOB = """\
model:
  architecture: t5
  task: sequence-classification
  config:
    d_modle: 64
    num_layers: [2]
data:
  synthetic: {num_samples: 16, seq_len: 8}
training: {max_steps: 1}
logging: {mlflow: {enabled: false}}
"""


def test_unknown_key_and_wrong_type_are_refused_by_every_command_alike(tmp_path, capsys):
    job = tmp_path / "t5.yaml"
    job.write_text(T5_JOB)
    for command in (["validate"], ["plan"], ["compile"], ["launch", "--dry-run"]):
        assert main([command[0], str(job), *command[1:]]) == 2, command
        err = capsys.readouterr().err
        assert f"{job}:5:5: model.config.d_modle: unknown key `d_modle` for T5Config (t5)" in err, command
        assert "did you mean `d_model`?" in err
        assert f"{job}:6:17: model.config.num_layers: expected an integer, got list" in err
    assert not (tmp_path / "runs").exists()


def test_a_correct_config_passes_and_a_local_checkpoint_names_the_type(tmp_path, capsys):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 32, "custom_key": 1}))
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent("""\
        model:
          name_or_path: ckpt
          task: sequence-classification
          config: {d_model: 64, custom_key: 2, dropout_rat: 0.1}
        data:
          synthetic: {num_samples: 16, seq_len: 8}
        training: {max_steps: 1}
        logging: {mlflow: {enabled: false}}
        """))
    assert main(["launch", str(job), "--dry-run"]) == 2
    err = capsys.readouterr().err
    # config.json's own keys are accepted; the typo is not
    assert "custom_key" not in err and "model.config.d_model:" not in err
    assert "model.config.dropout_rat: unknown key `dropout_rat` for T5Config (t5)" in err
    assert "did you mean `dropout_rate`?" in err


def test_an_unknown_model_type_is_refused_before_anything_is_derived(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(T5_JOB.replace("architecture: t5", "architecture: someformer").replace(
        "    d_modle: 64\n    num_layers: [2]\n", "    hidden_size: 64\n"))
    assert main(["launch", str(job), "--dry-run"]) == 2
    assert "model.architecture: transformers" in capsys.readouterr().err


# ---------------------------------------------------------------- hub ids (no network: hub_config faked)

HUB_JOB = """\
model:
  name_or_path: someone/tiny-model
  task: sequence-classification
  config: {hiddne_size: 64, custom_flag: false}
data:
  synthetic: {num_samples: 16, seq_len: 8}
training: {max_steps: 1}
logging: {mlflow: {enabled: false}}
"""


def _hub(monkeypatch, config=None, error=None):
    from jobspec.job import model_config
    asked = []

    def fake(name, revision=None):
        asked.append((name, revision))
        if error is not None:
            raise error
        return dict(config)

    monkeypatch.setattr(model_config, "hub_config", fake)
    return asked


def _issues(tmp_path, text=HUB_JOB):
    from jobspec.job.model_config import job_model_config_issues
    from jobspec.spec.validation import load_and_validate
    job = tmp_path / "job.yaml"
    job.write_text(text)
    return job, [issue.render() for issue in job_model_config_issues(load_and_validate(job))]


def test_a_hub_id_of_a_type_in_the_table_is_checked_against_the_table(tmp_path, monkeypatch, capsys):
    asked = _hub(monkeypatch, {"model_type": "bert", "hidden_size": 768, "custom_flag": True})
    job = tmp_path / "job.yaml"
    job.write_text(HUB_JOB)
    assert main(["validate", str(job)]) == 0          # the type is unknown without the hub's config.json
    assert "plan, compile and launch --dry-run read it" in capsys.readouterr().out
    assert main(["launch", str(job), "--dry-run"]) == 2
    err = capsys.readouterr().err
    # the positioned error validate gives for a bert architecture; the checkpoint's own keys pass
    assert f"{job}:4:12: model.config.hiddne_size: unknown key `hiddne_size` for BertConfig (bert)" in err
    assert "did you mean `hidden_size`?" in err and "custom_flag" not in err
    assert asked and asked[0] == ("someone/tiny-model", None)


def test_a_hub_id_with_a_correct_config_passes(tmp_path, monkeypatch):
    _hub(monkeypatch, {"model_type": "bert"})
    assert _issues(tmp_path, HUB_JOB.replace("hiddne_size: 64, custom_flag: false", "hidden_size: 64"))[1] == []


def test_a_hub_id_outside_the_table_is_checked_against_transformers(tmp_path, monkeypatch):
    asked = _hub(monkeypatch, {"model_type": "t5", "custom_flag": True})
    job, issues = _issues(tmp_path, HUB_JOB.replace("hiddne_size: 64", "d_modle: 64").replace(
        "  config:", "  revision: v1.0\n  config:"))
    assert issues == [f"{job}:5:12: model.config.d_modle: unknown key `d_modle` for T5Config (t5) "
                      "(did you mean `d_model`?)"]   # custom_flag: the checkpoint's own key
    assert asked == [("someone/tiny-model", "v1.0")]


def test_a_hub_config_that_cannot_be_read_is_a_positioned_error(tmp_path, monkeypatch, capsys):
    _hub(monkeypatch, error=OSError("We couldn't connect to 'https://huggingface.co' to load the files"))
    job, issues = _issues(tmp_path)
    for command in (["plan"], ["compile"], ["launch", "--dry-run"]):   # the same refusal from each
        assert main([command[0], str(job), *command[1:]]) == 2
        assert "model.name_or_path: cannot read the config.json of `someone/tiny-model`" in capsys.readouterr().err
    assert len(issues) == 1
    assert issues[0].startswith(f"{job}:2:17: model.name_or_path: cannot read the config.json of "
                                "`someone/tiny-model`, so model.config cannot be checked: We couldn't connect")
    assert "the ranks would fail to load it the same way" in issues[0]


def test_no_model_config_reads_nothing(tmp_path, monkeypatch):
    asked = _hub(monkeypatch, error=AssertionError("not called"))
    assert _issues(tmp_path, HUB_JOB.replace("  config: {hiddne_size: 64, custom_flag: false}\n", ""))[1] == []
    assert asked == []


def test_a_type_only_remote_code_defines_is_a_warning(tmp_path, monkeypatch, capsys):
    _hub(monkeypatch, {"model_type": "someones-own-former", "auto_map": {}})
    assert _issues(tmp_path, HUB_JOB.replace("  config:", "  trust_remote_code: true\n  config:"))[1] == []
    assert "jobspec: model.config is not checked: model type `someones-own-former`" in capsys.readouterr().err


def test_hub_config_reads_the_cache_before_the_hub(monkeypatch):
    from transformers import PreTrainedConfig

    from jobspec.job.model_config import hub_config
    calls = []

    def get_config_dict(name, **kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            raise OSError("not in the cache")
        return {"model_type": "bert"}, {}

    monkeypatch.setattr(PreTrainedConfig, "get_config_dict", get_config_dict)
    assert hub_config("someone/model", "main") == {"model_type": "bert"}
    assert calls == [{"revision": "main", "local_files_only": True}, {"revision": "main"}]
