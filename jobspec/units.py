"""Byte units and the two ways jobspec writes a size; neutral ground, no imports: anyone may use
them.

- `fmt_mib_gib`: memory sizes (the planner, the launch header, the fit search): always MiB or GiB,
  so the sizes of a plan line up and compare at a glance (`0.5 MiB`, `812.0 MiB`, `1.50 GiB`);
- `fmt_bytes_any_unit`: disk sizes (the pre-flight): the unit that keeps the number below 1024,
  from bytes to PiB (`512 bytes`, `3.2 KiB`, `2.2 GiB`, `3.0 TiB`).
"""
from __future__ import annotations

MiB, GiB = 2**20, 2**30
UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB")


def fmt_mib_gib(n: int | float) -> str:
    """`12.3 MiB` below a GiB, `1.50 GiB` from there on (signed: a negative headroom keeps its
    sign)."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    return f"{sign}{n / GiB:.2f} GiB" if n >= GiB else f"{sign}{n / MiB:.1f} MiB"


def fmt_bytes_any_unit(n: int | float) -> str:
    """`512 bytes`, `3.2 KiB`, `4.0 MiB`, `1.5 GiB`: the unit that keeps the number below 1024."""
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} bytes" if unit == 0 else f"{value:.1f} {UNITS[unit]}"
