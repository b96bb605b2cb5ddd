"""The one output layer: the same blocks as a rich table, plain text, or JSON.

Commands build a list of blocks (``Fields`` and ``Table``) or a pydantic model, and hand
them here. Data goes to stdout; errors and hints to stderr. Rich output only on a
terminal; ``--plain`` or a pipe gets aligned plain text; ``--json`` gets the model.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TextIO

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table as RichTable


class Mode(StrEnum):
    RICH = "rich"
    PLAIN = "plain"
    JSON = "json"


@dataclass(frozen=True)
class Fields:
    title: str
    items: Sequence[tuple[str, str]]


@dataclass(frozen=True)
class Table:
    title: str
    columns: Sequence[str]
    rows: Sequence[Sequence[str]]
    # Rows to emphasise (the chosen candidate), by index.
    highlight: frozenset[int] = field(default_factory=frozenset)


Block = Fields | Table


def choose_mode(*, json: bool, plain: bool, stream: TextIO | None = None) -> Mode:
    if json:
        return Mode.JSON
    stream = stream or sys.stdout
    if plain or not stream.isatty():
        return Mode.PLAIN
    return Mode.RICH


class Output:
    def __init__(self, mode: Mode, *, stream: TextIO | None = None) -> None:
        self.mode = mode
        self.stream = stream or sys.stdout

    def show(self, blocks: Sequence[Block], model: BaseModel | None = None) -> None:
        if self.mode is Mode.JSON:
            if model is None:
                raise ValueError("this output has no JSON form")
            self.stream.write(model.model_dump_json(indent=2) + "\n")
        elif self.mode is Mode.RICH:
            self._rich(blocks)
        else:
            self._plain(blocks)
        self.stream.flush()

    def _rich(self, blocks: Sequence[Block]) -> None:
        console = Console(file=self.stream)
        for block in blocks:
            if isinstance(block, Fields):
                table = RichTable(title=block.title, show_header=False, title_justify="left")
                table.add_column(style="bold")
                table.add_column()
                for key, value in block.items:
                    table.add_row(key, value)
            else:
                table = RichTable(title=block.title, title_justify="left")
                for column in block.columns:
                    table.add_column(column)
                for i, row in enumerate(block.rows):
                    table.add_row(*row, style="bold green" if i in block.highlight else None)
            console.print(table)

    def _plain(self, blocks: Sequence[Block]) -> None:
        out = self.stream
        for n, block in enumerate(blocks):
            if n:
                out.write("\n")
            out.write(f"{block.title}\n")
            if isinstance(block, Fields):
                width = max((len(k) for k, _ in block.items), default=0)
                for key, value in block.items:
                    out.write(f"  {key.ljust(width)}  {value}\n")
                continue
            rows = [list(block.columns), *[list(r) for r in block.rows]]
            widths = [max(len(r[i]) for r in rows) for i in range(len(block.columns))]
            for i, row in enumerate(rows):
                mark = "* " if i - 1 in block.highlight else "  "
                out.write(
                    mark
                    + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
                    + "\n"
                )


def error(message: str) -> None:
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
