"""The cross-field rules: what one field's schema cannot judge alone, one small module per concern.

Each rule is a function `(ResolvedSpec) -> list[SpecIssue]` on the defaults-filled spec, every issue
positioned (`r.issue`) and carrying its rule code (`validate --format json`). `spec/validation.py`
runs them in the order of its one list, `CROSS_FIELD_RULES` (adding a rule: a function here, one
line there), on a written spec and again on one `memory.fit: auto` changed (`validation.recheck`).

  choices                  exclusive pairs: max_steps/epochs, name_or_path/architecture, warmup
  data_sources             where the training and evaluation data come from, and that it exists
  data                     what validate can tell of the data without reading it: positions,
                           formats, the local tokenizer read as JSON, chat templates
  batch                    the batch split (the derived job's), positioned
  offload                  which ZeRO stage each offload needs, the NVMe path (also
                           `offload_problems`)
  precision                flash attention in fp32, `fp16.auto_cast` without fp16
  tracking                 system metrics without MLflow, the tracking URI's form
  paths                    NUL characters in paths
  checkpoint               `checkpoint.resume`: auto, never or an existing checkpoint

Other concerns keep their rules in their own module, listed in the same place: each technique's
(its module in jobspec/techniques, named there by the technique's name), each optimizer's
(jobspec/optimizers, `rule_issues`) and the export section's (export/rules).
`base` holds what they share: paths relative to the file that wrote them, did-you-mean.
Pure: no torch, no transformers; a rule reads at most a file's metadata or a small JSON file (a
config.json, a tokenizer's JSON, the first record of a data file), jinja2 for a chat template.
"""
