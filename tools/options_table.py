"""Write EngineConfig's options table (cli.options_table) into docs/usage.md, between its markers.

python tools/options_table.py
"""

from __future__ import annotations

from pathlib import Path

from specdecode.cli import options_table

USAGE = Path(__file__).resolve().parent.parent / "docs" / "usage.md"
BEGIN, END = "<!-- options table: written by tools/options_table.py -->", "<!-- end of options table -->"


def with_table(text: str) -> str:
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    return f"{head}{BEGIN}\n{options_table()}\n{END}{tail}"


if __name__ == "__main__":
    USAGE.write_text(with_table(USAGE.read_text()))
