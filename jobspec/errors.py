"""What can go wrong, by whose fault, and the exit code it gives.

- Bad input (a spec, a flag, a refused launch): each problem knows where it is (file:line:col,
  dotted path), what is wrong and how to fix it. Validation collects every `SpecIssue` and raises
  one `SpecError`, so a user sees all problems at once. Exit code 2.
- A valid job that failed while running (out of memory after `training.on_oom`, data that yields no
  batches, the tracking server unreachable at start): `RunFailure`, one line saying why. Exit code
  1.
"""
from __future__ import annotations

import difflib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

EXIT_INVALID = 2  # bad input: a spec error, a bad flag, a refused launch
# the input was fine but the run failed: OOM after the retries, no batches, tracking down
EXIT_RUN_FAILED = 1


@dataclass(frozen=True)
class SpecIssue:
    path: tuple = ()            # JSON path into the spec, e.g. ("memory", "zero_stage")
    message: str = ""           # what is wrong
    hint: str | None = None     # how to fix it ("did you mean ...", "set ...")
    file: str | None = None     # where: the file (or "<--set>") the offending node came from
    line: int | None = None     # 1-based
    column: int | None = None   # 1-based
    # the rule that found it (`offload-stage`, `schema-enum`): stable, for tools
    code: str | None = None

    @property
    def dotted_path(self) -> str:
        out = ""
        for part in self.path:
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        return out or "<root>"

    def location(self) -> str:
        if self.file is None:
            return "<spec>"
        if self.line is None:
            return self.file
        return f"{self.file}:{self.line}:{self.column or 1}"

    def render(self) -> str:
        text = f"{self.location()}: {self.dotted_path}: {self.message}"
        return f"{text} ({self.hint})" if self.hint else text

    def as_dict(self) -> dict:
        d = asdict(self)
        d["path"] = list(self.path)
        d["dotted_path"] = self.dotted_path
        return d


@dataclass
class SpecError(Exception):
    """One or more spec problems, raised once after collecting them all."""

    issues: list[SpecIssue] = field(default_factory=list)

    def __post_init__(self):
        super().__init__(self.render())

    def __str__(self) -> str:
        return self.render()

    def render(self, fmt: str = "text") -> str:
        ordered = sorted(self.issues, key=_sort_key)
        if fmt == "json":
            return json.dumps({"valid": False, "errors": [i.as_dict() for i in ordered]}, indent=2)
        lines = [i.render() for i in ordered]
        n = len(ordered)
        lines.append(f"{n} problem{'s' if n != 1 else ''} found")
        return "\n".join(lines)


def _sort_key(issue: SpecIssue):
    return (issue.file or "", issue.line or 0, issue.column or 0, issue.dotted_path)


def spec_error(message: str, *, path: tuple = (), hint: str | None = None, file: str | None = None,
               line: int | None = None, column: int | None = None,
               code: str | None = None) -> SpecError:
    """A SpecError with a single issue, for problems found outside schema validation."""
    return SpecError([SpecIssue(path=path, message=message, hint=hint, file=file, line=line,
                                column=column, code=code)])


def close_choices(word: str, choices: Sequence[str], *, n: int = 1,
                  cutoff: float = 0.6) -> list[str]:
    """The choices `word` most likely misspells, closest first: the one with the same letters in
    another case, else difflib's closest (at most `n`, at least `cutoff` alike)."""
    lowered = {c.lower(): c for c in choices}
    if word.lower() in lowered:
        return [lowered[word.lower()]]
    return difflib.get_close_matches(word, list(choices), n=n, cutoff=cutoff)


def did_you_mean(word: str, choices: Sequence[str], label: str = "", *, n: int = 1,
                 cutoff: float = 0.6,
                 quote: str = "`", prefix: str = "", beside: int = 0, shown: int | None = None,
                 more: str = "", otherwise: str | None = None) -> str:
    """The hint for `word`, which is none of `choices`: `did you mean `x`?` naming the closest
    (`close_choices`; `x` or `y` with n > 1; each written `prefix` + choice, in `quote`s), then the
    choices listed (`label: `a`, `b``) when there are at most `beside`. Nothing close: `otherwise`
    when given, else the listing -- its first `shown` choices and how many more (listed in
    `more`)."""
    close = close_choices(word, choices, n=n, cutoff=cutoff)
    listing = f"{label}: " + ", ".join(f"{quote}{c}{quote}" for c in choices[:shown])
    if shown is not None and len(choices) > shown:
        listing += f", and {len(choices) - shown} more" + (f" in {more}" if more else "")
    if not close:
        return listing if otherwise is None else otherwise
    named = " or ".join(f"{quote}{prefix}{c}{quote}" for c in close)
    return f"did you mean {named}?" + (f" {listing}" if len(choices) <= beside else "")


class RunFailure(Exception):
    """A run that failed at runtime through no fault of the spec: exit 1 with a one-line reason.

    Bad input (spec, data, model files) is a SpecError (exit 2); this is everything else a user
    can act on without editing the spec: memory, disk, an unreachable tracking server.
    """

    def __init__(self, reason: str, collective: bool = False):
        super().__init__(reason)
        self.reason = reason.splitlines()[0] if reason else "run failed"
        self.collective = collective  # raised on every rank alike: rank 0 alone reports it

    def __str__(self) -> str:
        return self.reason


def first_line(err: BaseException, *, limit: int | None = None) -> str:
    """The first line of an exception's message (its type's name when it has none), secrets masked:
    what a one-line error or warning shows of an error raised by a library. A first line that only
    introduces the next ("Class validation error for validator 'x':") is joined with it."""
    from jobspec.secrets import mask_secrets
    text = mask_secrets(str(err)).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    line = lines[0] if lines else type(err).__name__
    if line.endswith(":") and len(lines) > 1:
        line = f"{line} {lines[1]}"
    return line[:limit] if limit else line
