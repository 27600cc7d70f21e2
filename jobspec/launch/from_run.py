"""`jobspec launch --from-run RUN_ID`: launch the job an MLflow run logged, again.

Every launch logs `resolved.yaml` (the spec with every default filled, paths absolute, `--set`
and `memory.fit` already applied; credentials masked) as an artifact of its run. Launching that
file compiles the same DeepSpeed config byte for byte. What is changed, each with a printed note,
is only what would otherwise make the new launch continue the old one instead of repeating it:

- `checkpoint.dir`: when the parent's directory holds checkpoints, `resume: auto` would continue
  them (and reopen the parent's MLflow run): the new run saves to a new sibling directory;
- `memory.fit: auto` becomes `off`: the fitted settings are already in the spec (a GPU with
  other free memory would fit differently);
- `logging.mlflow.tracking_uri`: the store the spec was fetched from (the logged one may be a
  relative sqlite path, or carry `***` for a masked password);
- the tag `jobspec.parent_run_id` (a logging.mlflow tag) names the parent. MLflow's own
  `mlflow.parentRunId` is not set: it makes a run a nested child shown under its parent (a step
  of a larger run, such as one trial of a sweep), which a re-launch is not.

`--set` overrides apply after these changes, as on a spec file. Pure apart from MLflow: no torch.
Reading the parent creates nothing: a local store that does not exist (the default
`sqlite:///mlflow.db` in another directory) is "not found", not a new empty database.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import yaml

from jobspec import rundir
from jobspec.errors import first_line, spec_error
from jobspec.secrets import mask_secrets, split_credentials
from jobspec.tracking.store import missing_local_store

PARENT_TAG = "jobspec.parent_run_id"
LOGGED_SPEC = rundir.RESOLVED
# the schema's default for logging.mlflow.tracking_uri
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


def tracking_uri_or_default(uri: str | None) -> str:
    return uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


def fetch_spec(run_id: str, tracking_uri: str, dest: Path) -> Path:
    """Download the run's resolved.yaml into `dest`; a clear SpecError for every way that can
    fail."""
    from jobspec.tracking import run as telemetry

    uri, user, password = split_credentials(tracking_uri)
    shown = mask_secrets(tracking_uri)
    if user:  # as for a launch: MLflow reads basic-auth credentials from the environment
        os.environ["MLFLOW_TRACKING_USERNAME"] = user
        os.environ["MLFLOW_TRACKING_PASSWORD"] = password or ""
    hint_store = ("pass the tracking URI that holds the run with --tracking-uri (or set "
                  "MLFLOW_TRACKING_URI)")
    missing = missing_local_store(uri)
    if missing is not None:   # MLflow would create an empty store there just to find no run in it
        raise spec_error(f"MLflow run {run_id} not found: no MLflow store at {missing} (tracking "
                         f"URI {shown})",
                         hint="run from the directory the job was launched in, or " + hint_store)
    try:
        telemetry.probe(uri)
        client = telemetry.client_for(uri)
        client.get_run(run_id)
        names = {a.path for a in client.list_artifacts(run_id)}
        if LOGGED_SPEC not in names:
            raise spec_error(f"MLflow run {run_id} has no logged job spec (no {LOGGED_SPEC} "
                             "artifact)",
                             hint="--from-run needs a run started by `jobspec launch`; launch its "
                                  "spec file instead")
        return Path(client.download_artifacts(run_id, LOGGED_SPEC, str(dest)))
    except telemetry.TrackingUnavailable as err:
        raise spec_error(f"MLflow tracking at {shown} is unavailable: {err}",
                         hint=hint_store) from None
    except Exception as err:
        if getattr(err, "error_code", None) in ("RESOURCE_DOES_NOT_EXIST",
                                                "INVALID_PARAMETER_VALUE"):
            raise spec_error(f"MLflow run {run_id} not found in {shown}", hint=hint_store) from None
        if type(err).__name__ == "SpecError":
            raise
        first = first_line(err, limit=300)
        raise spec_error(f"cannot read MLflow run {run_id} from {shown}: {first}",
                         hint=hint_store) from None


def relaunch_spec(logged: Path, run_id: str, tracking_uri: str,
                  overrides: list[str]) -> tuple[Path, list[str]]:
    """The spec file to launch (next to `logged`) and the notes saying what differs from the logged
    one."""
    try:
        spec = yaml.safe_load(logged.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as err:
        raise spec_error(f"the job spec logged by MLflow run {run_id} cannot be read: {err}",
                         hint="launch the run's spec file instead") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("logging"), dict):
        raise spec_error(f"the {LOGGED_SPEC} logged by MLflow run {run_id} is not a resolved job "
                         "spec",
                         hint="--from-run needs a run started by `jobspec launch`")
    notes = []
    overridden = {item.split("=", 1)[0].strip() for item in overrides}
    mlflow_settings = spec["logging"].setdefault("mlflow", {})
    if "logging.mlflow.tracking_uri" not in overridden \
            and mlflow_settings.get("tracking_uri") != tracking_uri:
        notes.append(f"logging to {mask_secrets(tracking_uri)}, the store of the parent run "
                     f"(it logged to {mlflow_settings.get('tracking_uri')})")
        mlflow_settings["tracking_uri"] = tracking_uri
    mlflow_settings.setdefault("tags", {})[PARENT_TAG] = run_id
    memory = spec.get("memory") or {}
    if memory.get("fit") == "auto" and "memory.fit" not in overridden:
        memory["fit"] = "off"
        notes.append("memory.fit: off -- the parent's fitted settings are in its spec already")
    checkpoint = spec.get("checkpoint") or {}
    ckpt_dir = checkpoint.get("dir")
    if ckpt_dir and not overridden & {"checkpoint.dir", "checkpoint.resume"} \
            and _has_checkpoints(Path(ckpt_dir)):
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        checkpoint["dir"] = f"{ckpt_dir.rstrip('/')}-from-{run_id[:8]}-{stamp}"
        notes.append(f"checkpoint.dir {checkpoint['dir']}: {ckpt_dir} holds the parent's "
                     "checkpoints, which `resume: auto` would continue (--set checkpoint.dir=... "
                     "to choose)")
    target = logged.with_name(f"from-run-{run_id}.yaml")
    target.write_text(f"# job spec of MLflow run {run_id}, launched again by `jobspec launch "
                      "--from-run`\n"
                      + yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return target, notes


def _has_checkpoints(ckpt_dir: Path) -> bool:
    try:
        return any(p.name not in ("jobspec_job.json",)
                   and not p.name.startswith(".jobspec-write-test")
                   for p in ckpt_dir.iterdir())
    except OSError:
        return False


def spec_file_of_run(run_id: str, tracking_uri: str | None,
                     overrides: list[str]) -> tuple[Path, list[str]]:
    """Fetch and adapt the spec of `run_id`: (spec file to launch, notes). The file lives in a
    private temp dir removed at exit (the run directory keeps its text, masked, as spec.yaml)."""
    uri = tracking_uri_or_default(tracking_uri)
    dest = Path(tempfile.mkdtemp(prefix=f"jobspec-from-run-{run_id[:8]}-"))
    atexit.register(shutil.rmtree, dest, True)
    return relaunch_spec(fetch_spec(run_id, uri, dest), run_id, uri, overrides)


def job_argument(args) -> str:
    """The spec file `jobspec launch` runs: JOB, or the fetched spec of --from-run (notes
    printed)."""
    if args.from_run and args.job:
        raise spec_error("give a job spec or --from-run, not both", hint="jobspec launch JOB, or "
                                                                       "jobspec launch --from-run "
                                                                       "RUN_ID")
    if not args.from_run:
        if not args.job:
            raise spec_error("no job spec given",
                             hint="jobspec launch JOB, or jobspec launch --from-run RUN_ID")
        if args.tracking_uri:
            raise spec_error("--tracking-uri names the store of --from-run",
                             hint="a spec file sets its store in logging.mlflow.tracking_uri (or "
                                  "--set it)")
        return args.job
    path, notes = spec_file_of_run(args.from_run, args.tracking_uri, args.overrides)
    for note in notes:
        print(f"jobspec: from run {args.from_run}: {note}", flush=True)
    return str(path)
