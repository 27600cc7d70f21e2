"""scripts/wrap_lines.py: long lines wrapped in the house style, the code itself unchanged."""
from __future__ import annotations

import ast
import sys
import textwrap

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "scripts"))
import wrap_lines  # noqa: E402  (the script, imported as a module)

sys.path.remove(str(REPO_ROOT / "scripts"))


def wrapped(source: str) -> str:
    text, left = wrap_lines.wrap(textwrap.dedent(source))
    assert left == [], text
    assert all(len(line) <= wrap_lines.LIMIT for line in text.splitlines())
    return text


def test_a_long_trailing_comment_moves_above_its_code_and_a_marker_stays():
    text = wrapped(f"""
        def f():
            value = compute(1)   # {"why " * 24}
            try:
                pass
            except Exception:  # noqa: BLE001 -- {"because " * 12}
                pass
        """)
    lines = text.splitlines()
    assert lines[2].strip().startswith("# why") and lines[-4].strip().startswith("# because")
    assert "value = compute(1)" in text and "except Exception:  # noqa: BLE001" in text


def test_code_breaks_inside_its_brackets_aligned_to_them():
    source = f"""result = function_name(first_argument, {", ".join(f"argument_{i}" for i in range(12))})\n"""
    text = wrapped(source)
    first, second = text.splitlines()[:2]
    assert first.endswith(",") and second.startswith(" " * len("result = function_name("))
    assert ast.dump(ast.parse(source)) == ast.dump(ast.parse(text))


def test_a_long_string_is_cut_at_a_space_into_adjacent_literals():
    source = f"""raise ValueError(f"the value {{value}} {"is far too long " * 8}")\n"""
    text = wrapped(source)
    assert len(text.splitlines()) == 2 and ast.dump(ast.parse(source)) == ast.dump(ast.parse(text))


def test_docstring_prose_flows_and_a_table_is_left_for_a_hand():
    prose = wrapped(f'''
        def f():
            """{"A sentence of words. " * 6}
            and its next line."""
        ''')
    assert ast.get_docstring(ast.parse(prose).body[0]).split() == \
        ("A sentence of words. " * 6 + "and its next line.").split()
    table = textwrap.dedent(f'''
        """Files:

          spec.yaml        {"the spec as written " * 4}   compile -> sync
        """
        ''')
    text, left = wrap_lines.wrap(table)
    assert text == table and left == [4]
