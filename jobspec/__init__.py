"""jobspec: one declarative YAML file per training job, validated, compiled to DeepSpeed, launched,
logged."""

__version__ = "0.1.0"
