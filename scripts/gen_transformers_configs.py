"""Generate schemas/transformers-configs.json: the `model.config` keys each supported architecture takes.

    python scripts/gen_transformers_configs.py              # rewrite the shipped table
    python scripts/gen_transformers_configs.py --out FILE   # write it elsewhere (the staleness test)

`jobspec validate` checks `model.config` against this table without importing transformers
(jobspec/spec/freeform.py). transformers 5 config classes are dataclasses that take any keyword:
an unknown one becomes a stray attribute, so the table is the only thing that catches a typo.
Per architecture it records the config class's dataclass fields (with a type derived from each
annotation), the class's `attribute_map` aliases (`hidden_size` for GPT-2's `n_embd`), and the
keywords `PreTrainedConfig.__post_init__` consumes without a field. Types are JSON Schema type
names plus "float": a Python `float` annotation, which transformers' strict dataclasses refuse
an int for (`initializer_range: 1` fails, `1.0` passes).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "schemas" / "transformers-configs.json"
sys.path.insert(0, str(ROOT))

from jobspec.launch.model_config import common_fields, dataclass_fields, transformers_entry  # noqa: E402


def architectures() -> list[str]:
    from jobspec.spec.model_dims import ARCHITECTURE_DEFAULTS
    return sorted(ARCHITECTURE_DEFAULTS)


def mlp_entry() -> dict:
    from jobspec.model.mlp import CONFIG_KEYS, MLPConfig

    fields = dataclass_fields(MLPConfig)
    return {"class": "jobspec.model.mlp.MLPConfig", "common": False,
            "fields": {name: fields[name] for name in CONFIG_KEYS}, "aliases": {}}


def build() -> dict:
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    common = common_fields()
    table = {}
    for model_type in architectures():
        if model_type == "mlp":
            table[model_type] = mlp_entry()
        elif model_type in CONFIG_MAPPING:
            table[model_type] = transformers_entry(model_type, common)
        else:
            raise SystemExit(f"{model_type} (jobspec/spec/model_dims.py) is not a transformers model_type")
    return {
        "generated_by": "scripts/gen_transformers_configs.py",
        "transformers_version": transformers.__version__,
        "types": "JSON Schema type names; float: a Python float annotation (an integer is refused)",
        "common": common,
        "architectures": table,
    }


def render(table: dict) -> str:
    return json.dumps(table, indent=1, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    args.out.write_text(render(build()), encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
