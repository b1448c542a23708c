"""The terminal screens of every command (`recovery-run`, `recovery-daemon --demo`, `recovery-ctl`,
`recovery-replay`): one console and one rule for tables, so that each screen reads at 80 columns.

- The width: the terminal's when there is one (on standard output, input or error, so that `| less` still fits the
  terminal), else `COLUMNS`, else 80. Never a wider guess: a piped screen read in a terminal of 80 columns must fit.
- Piped output is plain: no colours, no cursor movement (rich leaves them out when no terminal is written to).
- Tables: a number or an identifier is never broken inside (`number`, `ident`: no wrap); only free text wraps, at
  words (`text`). A table whose unbreakable columns do not fit is shown as several tables of the columns that fit,
  each led by the row's key (`column_groups`), rather than cutting values to a few letters.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Literal

from rich.console import Console
from rich.table import Table
from rich.text import Text

NARROWEST = 80
"""the width every screen is made to read at"""
TEXT_MIN = 16
"""the fewest characters a free-text column is given before a table is split: fewer reads as a column of letters"""
BOX_PER_COLUMN = 3
"""a boxed table's border and padding per column (one more for the last border)"""

Kind = Literal["number", "ident", "text"]


def screen_console(file: IO[str] | None = None, *, stderr: bool = False) -> Console:
    """The console every screen prints to: the terminal's width, else COLUMNS, else 80 (rich's own rule, never
    overridden with a wider guess for piped output); no highlighting of numbers in plain strings, which would
    colour parts of identifiers."""
    return Console(file=file, stderr=stderr, highlight=False)


def terminal_width(stream: IO[str] | None = None) -> int:
    """The same width for plain lines (`print`): COLUMNS, else the terminal of `stream` or of standard output,
    input or error, else 80."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    for candidate in (stream, sys.__stdout__, sys.__stdin__, sys.__stderr__):
        try:
            width = os.get_terminal_size(candidate.fileno()).columns if candidate is not None else 0
        except (AttributeError, ValueError, OSError):  # not a terminal, or not a file at all
            continue
        if width > 0:
            return width
    return NARROWEST


@dataclass(frozen=True)
class Column:
    header: str
    kind: Kind = "ident"

    def add_to(self, table: Table) -> None:
        """The table rule: numbers right-aligned and unbroken, identifiers unbroken, free text wrapped at words
        (a word longer than the column folded, the only place a value may break)."""
        if self.kind == "number":
            table.add_column(self.header, justify="right", no_wrap=True)
        elif self.kind == "ident":
            table.add_column(self.header, no_wrap=True)
        else:
            table.add_column(self.header, overflow="fold", min_width=min(TEXT_MIN, len(self.header)))


def _cell_width(cell: str | Text) -> int:
    text = cell.plain if isinstance(cell, Text) else cell
    return max((len(line) for line in text.splitlines()), default=0)


def column_width(column: Column, cells: Sequence[str | Text]) -> int:
    """What the column needs: its widest cell or header line (a free-text header may wrap at its words), and for
    free text no more than TEXT_MIN, since it wraps."""
    lines = column.header.splitlines() or [""]
    header = max(len(word) for word in column.header.split()) if column.kind == "text" and column.header.strip() \
        else max(len(line) for line in lines)
    widest = max([header, *(_cell_width(c) for c in cells)])
    return min(widest, max(TEXT_MIN, header)) if column.kind == "text" else widest


def column_groups(columns: Sequence[Column], rows: Sequence[Sequence[str | Text]], width: int,
                  key: int = 1) -> list[list[int]]:
    """The columns (by index) of the tables to show for these rows in `width` characters of boxed tables: all in
    one if they fit, else as many as fit in each, every table led by the first `key` columns (what names a row)."""
    needs = [column_width(c, [row[i] for row in rows]) + BOX_PER_COLUMN for i, c in enumerate(columns)]
    lead = list(range(key))
    used = 1 + sum(needs[i] for i in lead)
    groups: list[list[int]] = []
    group = list(lead)
    for i in range(key, len(columns)):
        if len(group) > key and used + needs[i] > width:
            groups.append(group)
            group, used = list(lead), 1 + sum(needs[j] for j in lead)
        group.append(i)
        used += needs[i]
    groups.append(group)
    return groups


def fitted_tables(title: str, columns: Sequence[Column], rows: Sequence[Sequence[str | Text]], width: int,
                  key: int = 1) -> list[Table]:
    """The rows as one table, or as several (`title (1 of 2)`...) when their columns do not fit in `width`."""
    groups = column_groups(columns, rows, width, key)
    tables = []
    for n, group in enumerate(groups, 1):
        table = Table(title=title if len(groups) == 1 else f"{title} ({n} of {len(groups)})")
        for i in group:
            columns[i].add_to(table)
        for row in rows:
            table.add_row(*(row[i] for i in group))
        tables.append(table)
    return tables


def shortened(text: str, width: int, lines: int = 1) -> str:
    """`text` cut at a word to fit `lines` lines of `width` characters, with `…` where it was cut: a live screen's
    reason that must not push the newer ones off the screen."""
    limit = max(1, width * lines - (lines - 1) * 2)  # the words wrapped onto each further line leave a little room
    if len(text) <= limit:
        return text
    cut = text[: limit - 1]
    space = cut.rfind(" ")
    if space > limit // 2:
        cut = cut[:space]
    return cut.rstrip(" ,;:") + "…"
