"""What ``Plan.table()`` and ``TrainReport.table()`` return: a ``rich`` table that ``print``
shows as text (a plain one prints as ``<rich.table.Table object at ...>``)."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

__all__ = ["PrintableTable"]

_WIDTH = 120  # wide enough for a plan of 6 devices; str() has no terminal to ask


class PrintableTable(Table):
    """A ``rich`` table whose ``str`` is its rendering as plain text.

    >>> t = PrintableTable(title="plan")
    >>> t.add_column("device"); t.add_row("cuda:0")
    >>> print(t)
       plan
    ┏━━━━━━━━┓
    ┃ device ┃
    ┡━━━━━━━━┩
    │ cuda:0 │
    └────────┘
    """

    def __str__(self) -> str:
        buffer = io.StringIO()
        console = Console(file=buffer, width=_WIDTH, color_system=None, force_terminal=False)
        console.print(self)
        return "\n".join(line.rstrip() for line in buffer.getvalue().splitlines())

    def __repr__(self) -> str:
        return f"<{type(self).__name__}: {self.title or 'untitled'}, {len(self.rows)} rows>"
