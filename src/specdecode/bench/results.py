"""Where benchmark results go: a JSON file per run, which records the command line that produced it."""
from __future__ import annotations

import json
import os
import sys


def command_line() -> str:
    return "specdecode " + " ".join(sys.argv[1:])


def write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"wrote {path}")
