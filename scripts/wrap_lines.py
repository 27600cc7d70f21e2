"""Wrap the lines of Python files that run past a limit, in the house style, code unchanged.

    python scripts/wrap_lines.py jobspec               # every file under jobspec/, in place
    python scripts/wrap_lines.py --check jobspec/x.py  # only list the long lines (exit 1)

One line at a time, until none is too long:

- a trailing comment moves to its own line above the code it explains (`# noqa`, `# type:` stay);
- a comment line, or a docstring's prose line, breaks at its last space that fits, and the rest
  flows into the next line of the same paragraph (a new line where the paragraph ends);
- a code line breaks inside its brackets after a comma (else before `and`, `or`, `if`, `else`,
  `for`, `+`), the rest aligned one column past the innermost open bracket (or, for a bracket
  that ends its line, with that bracket's continuation); else a string literal inside brackets is
  cut at a space into two adjacent literals.

Each file's syntax tree is compared before it is written: only docstrings' whitespace may differ.
What cannot be wrapped this way (a long token, a statement outside brackets, a docstring's
indented example) is listed for a hand to do.
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import sys
import textwrap
import tokenize
from pathlib import Path

LIMIT = 100
KEEP_TRAILING = re.compile(r"#\s*(noqa|type:|pragma|fmt:)")
# a tool's marker, then the words that explain it (`# noqa: BLE001 -- why`)
TOOL_MARKER = re.compile(r"^(#\s*(?:noqa|type:|pragma|fmt:)[^#]*?)"
                         r"(?:\s+(?:--?|#)\s+|\s*#\s*)(\S.*)$")
BULLET = re.compile(r"^(\s*)([-*•]|\d+[.)]) ")
COLUMNS = re.compile(r"\S {3,}\S")   # a table's or a listing's columns: laid out by hand
SPLIT_AFTER = {","}
SPLIT_BEFORE = ("and", "or", "if", "else", "for", "+")
LAYOUT = (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER,
          tokenize.COMMENT)
OPEN, CLOSE = "([{", ")]}"


def docstring_spans(tree: ast.Module) -> list[tuple[int, int, int]]:
    """(first line, last line, column of the opening quotes) of every docstring."""
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                spans.append((first.lineno, first.end_lineno or first.lineno, first.col_offset))
    return spans


def normalized(tree: ast.AST) -> str:
    """The tree with docstrings' whitespace collapsed: what wrapping may not change."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                first.value.value = " ".join(first.value.value.split())
    return ast.dump(tree)


def break_at(text: str, room: int) -> int | None:
    """The last space of `text` at or before `room` (the text before it fits), or None."""
    cut = text.rfind(" ", 0, room + 1)
    while cut > 0 and text[cut - 1] == " ":
        cut -= 1
    return cut if cut > 0 and text[:cut].strip() else None


def flow(lines: list[str], index: int, head: str, rest: str, cont: str, joins) -> None:
    """Line `index` becomes `head`; `rest` goes to the next line when `joins(next)` (a line of the
    same paragraph), else onto a new line `cont` + rest."""
    lines[index] = head.rstrip()
    following = lines[index + 1] if index + 1 < len(lines) else None
    if following is not None and joins(following):
        body = following[len(cont):]
        lines[index + 1] = f"{cont}{rest} {body}"
    else:
        lines.insert(index + 1, f"{cont}{rest}")


def fix_comment(lines: list[str], index: int) -> bool:
    line = lines[index]
    match = re.match(r"^(\s*)(#+ ?)(.*)$", line)
    if match is None:
        return False
    indent, marker, text = match.groups()
    if COLUMNS.search(text.strip()):
        return False   # a table in a comment: by hand
    dashes = re.match(r"^(.*?\S)\s*(-{5,})$", text)
    if dashes:   # a section rule `# --- title -----`: shortened to the limit
        keep = LIMIT - len(indent + marker + dashes.group(1)) - 1
        if keep >= 3:
            lines[index] = f"{indent}{marker}{dashes.group(1)} {'-' * keep}"
            return True
    cut = break_at(text, LIMIT - len(indent + marker))
    if cut is None:
        return False
    prefix = indent + marker

    def joins(following: str) -> bool:
        return following.startswith(prefix) and following[len(prefix):].strip() != "" \
            and not COLUMNS.search(following[len(prefix):].strip()) \
            and not following[len(prefix):].startswith((" ", "-", "*")) \
                and not KEEP_TRAILING.match(following.strip())
    flow(lines, index, prefix + text[:cut], text[cut:].strip(), prefix, joins)
    return True


def balanced(text: str, width: int) -> list[str]:
    """`text` in as few lines as `width` allows, each as short as that count allows (no orphan)."""
    lines = textwrap.wrap(text, width=width, break_long_words=False)
    narrowest = width
    while narrowest > 20 \
            and len(textwrap.wrap(text, width=narrowest - 1, break_long_words=False)) == len(lines):
        narrowest -= 1
    return textwrap.wrap(text, width=narrowest, break_long_words=False)


def fix_trailing(lines: list[str], index: int, comment: tokenize.TokenInfo, first_code_col: int,
                 continuation: bool) -> bool:
    if index and lines[index - 1].rstrip().endswith("\\"):
        return False   # a line after a backslash: no comment may sit between the two
    line = lines[index]
    code = line[:comment.start[1]].rstrip()
    text = comment.string.lstrip("#").strip()
    if KEEP_TRAILING.match(comment.string):   # a tool's marker stays; the words after it move
        marker = re.match(TOOL_MARKER, comment.string)
        if marker is None:
            return False
        code = f"{code}  {marker.group(1).rstrip()}"
        text = marker.group(2)
    indent = " " * (len(line) - len(line.lstrip()))
    width = LIMIT - len(indent) - 2
    above = [f"{indent}# {part}" for part in balanced(text, width)]
    lines[index:index + 1] = above + [code]
    return True


def fix_docstring(lines: list[str], index: int, base: int, opening: bool, last: int) -> bool:
    """Line `index` of a docstring whose quotes open at column `base` and close on line `last`."""
    line = lines[index]
    indent = len(line) - len(line.lstrip())
    if (not opening and indent > base + 2 and not BULLET.match(line)) or COLUMNS.search(line):
        return False   # an indented example, a table: by hand
    bullet = BULLET.match(line)
    cont = " " * (len(bullet.group(0)) if bullet else (base if opening else indent))
    cut = break_at(line, LIMIT)
    if cut is None or cut <= indent + (3 if opening else 0):
        return False

    def joins(following: str) -> bool:
        stripped = following.strip()
        return (index + 2 <= last and stripped != "" and not COLUMNS.search(following)
                and not stripped.startswith(('"""', "'''")) and following.startswith(cont)
                and not following[len(cont):].startswith(" ") and not BULLET.match(following)
                and len(following) - len(following.lstrip()) == len(cont))
    flow(lines, index, line[:cut], line[cut:].strip(), cont, joins)
    return True


def string_split(token: tokenize.TokenInfo, room: int) -> tuple[str, str] | None:
    """`token` (a one-line string literal) as two adjacent literals, the first at most `room`
    long."""
    match = re.match(r"^([rRbBfFuU]*)('|\")(.*)\2$", token.string, re.S)
    if match is None or token.string.startswith(('"""', "'''")) or len(match.group(3)) < 2:
        return None
    prefix, quote, body = match.groups()
    fmt = "f" in prefix.lower()
    allowed = set()
    depth = 0
    i = 0
    while i < len(body):
        ch = body[i]
        if fmt and body[i:i + 2] in ("{{", "}}"):
            i += 2
            continue
        if fmt and ch == "{":
            depth += 1
        elif fmt and ch == "}":
            depth -= 1
        elif ch == " " and depth == 0 and i > 0 and body[i - 1] != "\\":
            allowed.add(i + 1)   # cut after the space
        i += 1
    fits = [k for k in allowed if len(prefix) + 1 + k + 1 <= room and k < len(body)]
    if not fits:
        return None
    k = max(fits)

    def literal(part: str) -> str:
        own = prefix
        if fmt and not re.search(r"(?<!\{)\{(?!\{)", part.replace("{{", "")):
            own = prefix.replace("f", "").replace("F", "")
            part = part.replace("{{", "{").replace("}}", "}")
        return f"{own}{quote}{part}{quote}"
    return literal(body[:k]), literal(body[k:])


def fix_code(lines: list[str], index: int, tokens: list[tokenize.TokenInfo]) -> bool:
    """Break line `index` (0-based) inside its brackets."""
    number = index + 1
    line = lines[index]
    stack: list[tuple[tokenize.TokenInfo, bool]] = []   # open bracket, content after it on its line
    # (column, priority, continuation indent, depth)
    candidates: list[tuple[int, int, int, int]] = []
    strings = []
    # depths inside a `for` target or lambda's parameters: no break there
    targets: set[int] = set()
    outer: list[tuple[int, tokenize.TokenInfo]] = []   # the line's tokens outside brackets
    for position, token in enumerate(tokens):
        if token.start[0] > number:
            break
        if token.type == tokenize.OP and token.string in OPEN:
            after = tokens[position + 1] if position + 1 < len(tokens) else None
            content = after is not None and after.start[0] == token.start[0] \
                and after.type not in LAYOUT
            stack.append((token, content))
        elif token.type == tokenize.OP and token.string in CLOSE and stack:
            stack.pop()
        if token.type == tokenize.NAME and token.string in ("for", "lambda"):
            targets.add(len(stack))
        elif (token.type == tokenize.NAME and token.string == "in") or token.string == ":":
            targets.discard(len(stack))
        if token.start[0] == number and not stack and token.start[0] == token.end[0]:
            outer.append((position, token))
        if token.start[0] != number or not stack:
            continue
        bracket, content = stack[-1]
        if content:
            indent = bracket.start[1] + 1
        else:
            nxt = next((t for t in tokens[tokens.index(bracket) + 1:] if t.type not in LAYOUT),
                       None)
            base = lines[bracket.start[0] - 1]
            indent = nxt.start[1] if nxt is not None and nxt.start[0] > bracket.start[0] else \
                len(base) - len(base.lstrip()) + 4
        if token.type == tokenize.OP and token.string in SPLIT_AFTER and len(stack) not in targets:
            nxt = tokens[position + 1]
            if nxt.start[0] == number and nxt.type not in LAYOUT and nxt.string not in CLOSE:
                candidates.append((nxt.start[1], 0, indent, len(stack)))
        elif token.string in SPLIT_BEFORE and token.type in (tokenize.NAME, tokenize.OP):
            previous = tokens[position - 1]
            if previous.start[0] == number and previous.string not in OPEN and token.start[1] > 0:
                candidates.append((token.start[1], 1, indent, len(stack)))
        if token.type == tokenize.STRING and token.start[0] == token.end[0]:
            strings.append((token, indent))
    if outer_break(lines, index, tokens, outer, strings=False):
        return True
    fitting = [c for c in candidates if c[0] <= LIMIT and line[:c[0]].strip()
               and c[2] + len(line) - c[0] < len(line) and c[0] > len(line) - len(line.lstrip())]
    if fitting:
        # the rest fitting on its line, then the outermost bracket, a comma, the rightmost
        column, _, indent, _ = max(fitting,
                                   key=lambda c: (c[2] + len(line[c[0]:].lstrip()) <= LIMIT,
                                                            -c[3], -c[1], c[0]))
        rest = " " * indent + line[column:].lstrip()
        following = lines[index + 1] if index + 1 < len(lines) else ""
        has_comment = any(t.type == tokenize.COMMENT and t.start[0] == number for t in tokens)
        if (rest.rstrip().endswith(",") and not has_comment and following.strip()
                and not following.lstrip().startswith("#")
                and len(following) - len(following.lstrip()) == indent
                and len(rest) + 1 + len(following.lstrip()) <= LIMIT):
            lines[index:index + 2] = [line[:column].rstrip(), f"{rest} {following.lstrip()}"]
        else:
            lines[index:index + 1] = [line[:column].rstrip(), rest]
        return True
    for token, _ in sorted(strings, key=lambda s: -s[0].end[1]):
        if token.start[1] >= LIMIT - 10:
            continue   # the string's quotes and a word or more must fit before the limit
        parts = string_split(token, LIMIT - token.start[1])
        if parts is None:
            continue
        first, second = parts
        rest = " " * token.start[1] + second + line[token.end[1]:]
        following = lines[index + 1] if index + 1 < len(lines) else ""
        joined = join_literals(second, following.lstrip()) if not line[token.end[1]:].strip() \
            and len(following) - len(following.lstrip()) == token.start[1] else None
        if joined is not None:   # the rest flows into the literal that continues it
            lines[index:index + 2] = [line[:token.start[1]] + first, " " * token.start[1] + joined]
        else:
            lines[index:index + 1] = [line[:token.start[1]] + first, rest]
        return True
    return outer_break(lines, index, tokens, outer, strings=True)


def outer_break(lines: list[str], index: int, tokens: list[tokenize.TokenInfo],
                outer: list[tuple[int, tokenize.TokenInfo]], strings: bool) -> bool:
    """A one-line statement broken outside brackets: before an `and`, `or`, `if`, `else` or `+`
    with a backslash (the rest indented 4, or 8 under a compound statement's header), else its long
    string literal put in parentheses to be cut inside them."""
    line = lines[index]
    number = index + 1
    statement = [t for t in tokens if t.start[0] == number and t.type not in LAYOUT]
    if not statement or statement[0].start[1] != len(line) - len(line.lstrip()):
        return False   # a continuation line, or one that starts inside a string
    ends = [t for t in tokens if t.start[0] == number
            and t.type in (tokenize.NEWLINE, tokenize.COMMENT)]
    if not ends or any(t.type == tokenize.COMMENT for t in ends) or line.rstrip().endswith("\\"):
        return False
    base = len(line) - len(line.lstrip())
    header = statement[0].string in ("if", "elif", "while", "for", "with", "def", "class", "assert")
    indent = base + (8 if header else 4)
    fitting = [t for _, t in outer if t.string in SPLIT_BEFORE
               and t.type in (tokenize.NAME, tokenize.OP)
               and base + 4 < t.start[1] <= LIMIT - 2 and t is not statement[0]]
    if fitting:
        token = max(fitting, key=lambda t: (indent + len(line) - t.start[1] <= LIMIT, t.start[1]))
        lines[index:index + 1] = [line[:token.start[1]].rstrip() + " \\",
                                  " " * indent + line[token.start[1]:]]
        return True
    for _, token in outer if strings else []:
        if token.type == tokenize.STRING and token.start[1] < LIMIT < token.end[1] \
                and not token.string.startswith(('"""', "'''")):
            parts = string_split(token, LIMIT - token.start[1] - 1)
            if parts is None:
                continue
            lines[index:index + 1] = [line[:token.start[1]] + "(" + parts[0],
                                      " " * (token.start[1] + 1) + parts[1] + ")"
                                      + line[token.end[1]:]]
            return True
    return False


def join_literals(first: str, line: str) -> str | None:
    """`first` (a one-line literal) and the literal `line` starts with as one literal, the rest of
    `line` after it; None when `line` starts with none, or the two cannot be one (raw, bytes)."""
    try:
        token = next(t for t in tokenize.generate_tokens(io.StringIO(line).readline)
                     if t.type not in LAYOUT)
    except (tokenize.TokenError, StopIteration, SyntaxError):
        return None
    if token.type != tokenize.STRING or token.start != (1, 0):
        return None
    pattern = re.compile(r"^([fF]?)('|\")(.*)\2$", re.S)
    a, b = pattern.match(first), pattern.match(token.string)
    if a is None or b is None or a.group(2) != b.group(2):
        return None
    fmt = bool(a.group(1) or b.group(1))

    def body(match: re.Match) -> str:
        text = match.group(3)
        return text.replace("{", "{{").replace("}", "}}") if fmt and not match.group(1) else text
    quote = a.group(2)
    return f"{'f' if fmt else ''}{quote}{body(a)}{body(b)}{quote}{line[token.end[1]:]}"


def wrap(text: str, path: str = "<text>") -> tuple[str, list[int]]:
    """`text` with its long lines wrapped, and the numbers of the lines left too long."""
    lines = text.split("\n")
    stuck: set[int] = set()
    for _ in range(10 * len(lines)):
        source = "\n".join(lines)
        try:
            tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
            spans = docstring_spans(ast.parse(source))
        except (SyntaxError, tokenize.TokenError):
            break   # the last step broke the file: the comparison below refuses it
        long = [i for i, line in enumerate(lines) if len(line) > LIMIT and lines[i] not in stuck]
        if not long:
            break
        index = long[0]
        number = index + 1
        on_line = [t for t in tokens if t.start[0] == number]
        comment = next((t for t in on_line if t.type == tokenize.COMMENT), None)
        code = [t for t in on_line if t.type not in LAYOUT]
        inside = next(((s, e, c) for s, e, c in spans if s <= number <= e), None)
        continued = any(t.start[0] < number < t.end[0]
                        or (t.start[0] < number == t.end[0] and t.type == tokenize.STRING)
                        for t in tokens if t.type == tokenize.STRING)
        if inside is not None and (continued or number == inside[0]):
            done = fix_docstring(lines, index, inside[2], opening=number == inside[0],
                                 last=inside[1])
        elif continued:
            done = False   # a multi-line string that is no docstring: its newlines are its content
        elif comment is not None and code:
            first = code[0]
            done = fix_trailing(lines, index, comment, first.start[1], continuation=False)
            if not done:
                done = fix_code(lines, index, tokens)
        elif comment is not None:
            done = fix_comment(lines, index)
        else:
            done = fix_code(lines, index, tokens)
        if not done:
            stuck.add(lines[index])
    result = "\n".join(lines)
    try:
        same = normalized(ast.parse(text)) == normalized(ast.parse(result))
    except SyntaxError:
        same = False
    if not same:
        print(f"{path}: wrapping would change the code: left as it was", file=sys.stderr)
        return text, [i + 1 for i, line in enumerate(text.split("\n")) if len(line) > LIMIT]
    return result, [i + 1 for i, line in enumerate(lines) if len(line) > LIMIT]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path)
    parser.add_argument("--check", action="store_true", help="list the long lines, change nothing")
    parser.add_argument("--exclude", action="append", default=[], help="a file to leave alone")
    args = parser.parse_args(argv)
    files = [f for p in args.paths for f in (sorted(p.rglob("*.py")) if p.is_dir() else [p])
             if str(f) not in args.exclude]
    left = 0
    for path in files:
        text = path.read_text(encoding="utf-8")
        if args.check:
            long = [i for i, line in enumerate(text.split("\n"), 1) if len(line) > LIMIT]
        else:
            wrapped, long = wrap(text, str(path))
            if wrapped != text:
                path.write_text(wrapped, encoding="utf-8")
        for number in long:
            print(f"{path}:{number}: longer than {LIMIT}", file=sys.stderr)
        left += len(long)
    return 1 if left else 0


if __name__ == "__main__":
    raise SystemExit(main())
