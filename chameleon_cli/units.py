"""Parsing and formatting of the quantities commands take and show."""

from __future__ import annotations

import re

import typer

__all__ = [
    "duration_flag",
    "fmt_bytes",
    "fmt_ranges",
    "fmt_s",
    "parse_int_list",
]


def duration_flag(value: str | None, flag: str) -> float | None:
    """A flag's positive duration (None when not given); a usage error names the flag."""
    if value is None:
        return None
    from launcher.args import parse_duration_s  # one grammar for durations, the launcher's

    try:
        seconds = parse_duration_s(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint=flag) from None
    if seconds <= 0:
        raise typer.BadParameter("must be positive", param_hint=flag)
    return seconds


def parse_int_list(text: str) -> list[int]:
    """'3', '3,5', '0-3,8' -> sorted unique integers."""
    values: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if re.fullmatch(r"\d+-\d+", part):
            first, last = (int(x) for x in part.split("-"))
            if last < first:
                raise ValueError(f"empty range {part!r}")
            values.update(range(first, last + 1))
        elif re.fullmatch(r"\d+", part):
            values.add(int(part))
        else:
            raise ValueError(f"not a rank list: {text!r} (try 3 or 3,5 or 0-3)")
    return sorted(values)


def fmt_bytes(num: float | None) -> str:
    if num is None:
        return "-"
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num) >= size:
            return f"{num / size:.2f} {unit}"
    return f"{num:.0f} B"


def fmt_s(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} us"
    if seconds < 1:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120:
        return f"{seconds:.2f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"


def fmt_ranges(values: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5'."""
    parts = []
    values = sorted(values)
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(parts)
