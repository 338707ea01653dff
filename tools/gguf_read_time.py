"""Reading a GGUF file's metadata and building its tokenizer, each two ways in one run: gguf's reader over its numpy
memmap against the engine's (the same reader over a plain view of the map), and transformers' AutoTokenizer against
the fast tokenizer class the engine uses. Bundled model names or GGUF paths.

    python tools/gguf_read_time.py qwen2.5-coder-1.5b gemma3-270m [FILE.gguf ...]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

from gguf import GGUFReader
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from specdecode.bench.results import describe_machine, machine_info
from specdecode.models.gguf_loader import MappedReader
from specdecode.models.sources import resolve


def _seconds(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def read_times(path: str) -> list[float]:
    """Seconds to read the file with gguf's reader and the engine's, and to build its tokenizer both ways."""
    folder, name = os.path.split(os.path.abspath(path))
    return [
        _seconds(lambda: GGUFReader(path)),
        _seconds(lambda: MappedReader(path)),
        _seconds(lambda: AutoTokenizer.from_pretrained(folder, gguf_file=name)),
        _seconds(lambda: PreTrainedTokenizerFast.from_pretrained(folder, gguf_file=name)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", help="bundled names or GGUF paths")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    print(describe_machine(machine_info()))
    print("| file | gguf's reader (s) | the engine's (s) | AutoTokenizer (s) | the fast tokenizer class (s) |")
    print("|---|---:|---:|---:|---:|")
    for model in args.models:
        path = model if os.path.exists(model) else resolve(model).path
        times = read_times(path)
        print(f"| {os.path.basename(path)} | " + " | ".join(f"{t:.1f}" for t in times) + " |", flush=True)


if __name__ == "__main__":
    main()
