"""`model.config` of an architecture outside the shipped table is checked at launch, before any rank."""
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


def test_unknown_key_and_wrong_type_are_positioned_at_launch(tmp_path, capsys):
    job = tmp_path / "t5.yaml"
    job.write_text(T5_JOB)
    assert main(["validate", str(job)]) == 0          # t5 is not in schemas/transformers-configs.json
    assert "checked at launch" in capsys.readouterr().out
    assert main(["launch", str(job), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"{job}:5:5: model.config.d_modle: unknown key `d_modle` for T5Config (t5)" in err
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


def test_an_unknown_model_type_is_refused_at_launch(tmp_path, capsys):
    job = tmp_path / "job.yaml"
    job.write_text(T5_JOB.replace("architecture: t5", "architecture: someformer").replace(
        "    d_modle: 64\n    num_layers: [2]\n", "    hidden_size: 64\n"))
    assert main(["launch", str(job), "--dry-run"]) == 2
    assert "model.architecture: transformers" in capsys.readouterr().err
