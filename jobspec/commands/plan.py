"""Predict a job's per-GPU memory, and with --fit find the fastest settings that fit a budget.

Prints a per-rank breakdown (parameters, gradients, fp32 master weights, optimizer states,
activations, logits, ZeRO buffers), the predicted peak allocated / reserved memory, the NVML-style
total including the CUDA context, host RAM per rank and per node, and whether they fit the budgets
(--gpu-mem, else `memory.gpu_memory`; --host-mem, else `resources.host_mem`).
With --fit it searches micro-batch / accumulation, bf16, checkpointing one
layer in k, 8-bit AdamW, ZeRO stage and offload, keeping the global batch, and prints the cheapest
configuration that fits as --set overrides with its estimated step-time cost and tokens/s
(measured per GPU: --gpu H200; for causal LMs also the tiled loss, the tiled MLP and checkpoint
inputs offloaded to the host), and when `model.compile` pays for the job. With --longest it prints
the longest sequence that fits the budgets (GPU and host), for the job as written and for the
configuration --fit finds. The cost model is in docs/memory-planner.md. Exit code 2 on bad input
and for a node whose RAM cannot hold its ranks' host memory (with what to change); 1 when the job
does not fit its GPU budget (with --fit, or with `memory.fit: auto`, whose launch runs the fitted
settings: when nothing fits), the advice naming the term over budget and the technique that moves
it.

examples:
  jobspec plan jobs/xlmr-large.yaml --gpu-mem 24GiB
  jobspec plan jobs/gpt2-xl-12gb.yaml --fit --gpu-mem 12GiB
  jobspec plan jobs/xlmr-large.yaml --fit --gpu-mem 139GiB --gpu H200
  jobspec plan jobs/llama-8b-qlora-32k-24gb.yaml --longest
  jobspec plan jobs/llama-70b-zero3.yaml --host-mem 1TiB
  jobspec plan jobs/quickstart.yaml --format json
"""
from __future__ import annotations

import argparse
import dataclasses
import json

from jobspec.commands import add_format_argument, add_set_argument
from jobspec.errors import SpecError, spec_error

EXIT_NOTHING_FITS = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job spec file (YAML)")
    add_set_argument(parser)
    parser.add_argument("--gpu-mem", metavar="SIZE",
                        help="memory budget per GPU, e.g. 24GiB or 11GB (default: "
                             "memory.gpu_memory)")
    parser.add_argument("--host-mem", metavar="SIZE",
                        help="RAM of one node, e.g. 1TiB or 512GB (default: resources.host_mem)")
    parser.add_argument("--fit", action="store_true",
                        help="search for the fastest settings that fit the budget (global batch "
                             "unchanged)")
    parser.add_argument("--longest", action="store_true",
                        help="the longest sequence that fits the budgets, as written and with "
                             "--fit's settings")
    parser.add_argument("--no-bf16", action="store_true",
                        help="with --fit: the GPU lacks bf16 (pre-Ampere), so try fp16 instead")
    parser.add_argument("--gpu", metavar="NAME",
                        help="with --fit: the GPU whose measured speed prices the candidates and "
                             "gives the tokens/s, e.g. H200 (default: the reference formula; "
                             "docs/memory-planner.md)")
    add_format_argument(parser, {"text": "aligned table", "json": "one object (errors too)"})


def print_text(plan, spec, resolved, result, longest, *, show_fit: bool) -> None:
    """The text output: the plan's table and advice, the data lines, the random-base note, `--fit`'s
    lines (`show_fit`) and `--longest`'s (`result`: the fit's, whose overrides it names)."""
    from jobspec.memory.planner import render_plan
    from jobspec.memory.remedies import advice
    from jobspec.techniques.lora import random_base_note

    print(render_plan(plan, title=f"{spec['name']}: predicted memory per rank (as written)",
                      advice=advice(plan, spec)))
    for line in data_lines(resolved):   # the tokenised data's size: cached, else estimated
        print(f"data: {line}")
    base_note = random_base_note(spec)
    if base_note:
        print(f"note: {base_note}")
    if result is not None and show_fit:
        print()
        print("\n".join(fit_lines(result)))
    if longest is not None:
        print()
        for what, found in longest:
            print(longest_line(what, found,
                               result.overrides if result is not None and what != "as written"
                               else []))


def run(args: argparse.Namespace) -> int:
    from jobspec.hardware import Host
    from jobspec.job.prepare import AS_WRITTEN, prepare_job
    from jobspec.memory.fit import fit, longest_sequence
    from jobspec.memory.planner import parse_bytes

    cli_budget = (parse_bytes(args.gpu_mem, path=("--gpu-mem",)), "--gpu-mem") \
        if args.gpu_mem is not None else None
    host_budget = (parse_bytes(args.host_mem, path=("--host-mem",)),
                   "--host-mem") if args.host_mem is not None \
        else None

    def needs_budget(resolved) -> None:   # before the model is traced
        if (args.fit or args.longest) and cli_budget is None \
                and not resolved.spec["memory"]["gpu_memory"]:
            option = "--fit" if args.fit else "--longest"
            raise spec_error(f"{option} needs a memory budget", path=("memory", "gpu_memory"),
                             hint="pass --gpu-mem 24GiB or set memory.gpu_memory in the spec")

    # the spec as written (memory.fit is not applied: --fit shows what it would change); no host
    # probed: the budget is --gpu-mem or memory.gpu_memory
    job = prepare_job(args.job, args.overrides,
                      Host(gpu_free=None, bf16_supported=not args.no_bf16),
                      dataclasses.replace(AS_WRITTEN, budget=cli_budget, host_budget=host_budget),
                      checks=[needs_budget])
    assert job.memory is not None   # AS_WRITTEN plans it
    resolved, spec, budget = job.resolved, job.spec, job.memory.budget
    try:
        if job.memory.plan_error is not None:
            raise job.memory.plan_error
        plan = job.memory.plan
        assert plan is not None   # no plan_error: the planner counted the model
        result = longest = None
        if args.fit or args.longest:
            assert budget is not None   # needs_budget refuses --fit and --longest without one
            result = fit(spec, job.derived, budget, bf16_supported=not args.no_bf16,
                         host_budget=job.memory.host_budget, gpu=args.gpu)
        if args.longest:
            assert budget is not None and result is not None
            node_budget = job.memory.host_budget
            longest = [("as written", longest_sequence(spec, job.derived, budget,
                                                       host_budget=node_budget)),
                       ("with --fit's settings", longest_sequence(spec, job.derived, budget,
                                                                   host_budget=node_budget,
                                                                   changes=result.changes))]
    except SpecError as err:   # the model could not be built or traced: say where in the file
        raise resolved.locate(err) from None

    # a node that cannot hold the job is a bad input (exit 2, at resources.host_mem, with what to
    # change), unless --fit found settings that fit it; the text table is printed first, JSON is the
    # error alone
    problem = None
    if result is not None and result.host_limited:
        problem = resolved.locate(SpecError([result_issue(result, job.memory.host_budget_source)]))
    elif job.memory.host_problem is not None and (result is None or not result.fits):
        problem = resolved.locate(job.memory.host_problem)
    if args.format == "json":
        if problem is not None:
            raise problem
        print_json(plan, resolved, result, longest, show_fit=args.fit)
    else:
        print_text(plan, spec, resolved, result, longest, show_fit=args.fit)
    if problem is not None:
        raise problem
    if args.fit:
        return EXIT_NOTHING_FITS if result is not None and not result.fits else 0
    if plan.fits is False and spec["memory"]["fit"] == "auto" and budget is not None:
        # a launch runs what memory.fit: auto finds, not the spec as written: that is what must fit
        fitted = result if result is not None else fit(
            spec, job.derived, budget, bf16_supported=not args.no_bf16,
            host_budget=job.memory.host_budget, gpu=args.gpu)
        if args.format != "json":
            print(f"memory.fit: auto: {fitted.reason}" + ("" if not fitted.fits else
                  " (a launch applies: " + " ".join(f"--set {o}" for o in fitted.overrides) + ")"))
        return 0 if fitted.fits else EXIT_NOTHING_FITS
    return EXIT_NOTHING_FITS if plan.fits is False else 0


def fit_lines(result) -> list[str]:
    """--fit's text: the reason, the estimated speed, the overrides and their plan, the notes."""
    from jobspec.memory.planner import render_plan

    lines = [f"fit: {result.reason}"]
    if result.fits and result.speed is not None:
        lines.append(f"fit: {result.speed.text()}")
    if result.fits and result.changes:
        lines += ["  " + " ".join(f"--set {o}" for o in result.overrides), "",
                  render_plan(result.plan, title="with these settings:")]
    lines += [f"note: {note}" for note in result.notes]
    return [*lines, f"({result.considered} configurations considered)"]


def longest_line(what: str, found, overrides: list) -> str:
    """One line of --longest: the length, its peak and host RAM, the settings it needs."""
    from jobspec.units import fmt_mib_gib

    settings = (" (" + " ".join(f"--set {o}" for o in overrides) + ")") if overrides else ""
    if found.seq_len is None:
        short = "host RAM" if found.binding == "host" else "GPU memory"
        return f"longest sequence {what}: none fits, not even 64 tokens ({short} binds){settings}"
    plan = found.plan
    limit = {"positions": "the model's positions", "host": "host RAM binds",
             "gpu": "GPU memory binds"}[found.binding]
    return (f"longest sequence {what}: {found.seq_len:,} tokens ({limit}): "
            f"{fmt_mib_gib(plan.nvml_total)} per GPU, "
            f"host {fmt_mib_gib(plan.host_per_node)} per node{settings}")


def result_issue(result, source: str | None):
    """--fit's host-limited result as the issue at `resources.host_mem`."""
    from jobspec.errors import SpecIssue

    return SpecIssue(("resources", "host_mem"), result.reason,
                     hint=f"host budget from {source}; a node with more RAM, fewer ranks per node, "
                          "or the settings above with more GPUs")


def data_lines(resolved) -> list[str]:
    """The tokenised data of chat and prompt/completion records: its size when the data cache holds
    it, else about how big it will be and how long preparing it takes (data/prepare.py)."""
    if resolved.spec["data"]["synthetic"] is not None:
        return []   # random tokens: nothing is tokenised (nor data_prep's NumPy imported)
    from jobspec.data.prepare import prepare_data

    try:
        return prepare_data(resolved.spec, build=False)[0]
    except SpecError as err:
        raise resolved.locate(err) from None


def print_json(plan, resolved, result, longest, show_fit: bool) -> None:
    """`plan --format json`: the plan, what --fit found (`result`, shown with `show_fit`), and
    --longest's two answers (the second with --fit's settings)."""
    out = {"job": str(resolved.source), "plan": plan.as_dict()}
    if result is not None and show_fit:
        out["fit"] = result.as_dict()
    if longest is not None:
        out["longest"] = {"as_written": longest[0][1].as_dict(),
                          "fitted": {**longest[1][1].as_dict(),
                                     "overrides": result.overrides if result else []}}
    print(json.dumps(out, indent=2))
