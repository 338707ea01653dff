"""llama.cpp beside us, on the same GGUF files and prompts, in the same run.

`llama-bench` measures plain decoding (tg), also after a long context (tg @ depth), the cost of a forward
over 1, 2, 3, 5 tokens (pp), i.e. llama.cpp's verify cost ratio, and its prefill (pp512);
`llama-speculative-simple` runs its own draft-model speculation on each prompt. The binaries come from a
folder the user passes (e.g. built by build-llama-cpp.sh): llama.cpp is a peer to measure against, never a
dependency."""

from __future__ import annotations

import json
import os
import re
import subprocess
from dataclasses import dataclass

from ..errors import SpecDecodeError
from ..models.sources import default_draft
from ..proposers.registry import DRAFT_MODEL, proposer_kind

# llama-speculative-simple's n-gram modes (--spec-type), the peers of prompt lookup and suffix speculation
LLAMA_NGRAM_MODES = ("ngram-simple", "ngram-map-k", "ngram-mod", "ngram-cache")


def llama_cpp_draft(model: str, draft: str | None) -> str | None:
    """The draft model llama.cpp speculates with beside us: ours where `draft` names a model, else (a head, a
    lookup, a plug-in: nothing llama.cpp reads) the target's bundled draft model, llama.cpp's own best way to
    speculate; None where the target has none."""
    return default_draft(model, draft if proposer_kind(draft) in (None, DRAFT_MODEL) else None)


class LlamaCrashed(SpecDecodeError):
    """A llama.cpp tool died of a signal (not a bad argument)."""


# Where llama.cpp's repacked weights crash its batched forwards (its AMX kernels on some Intel hosts die
# of a general protection fault), it runs again with repacking off; decoding one token never takes that
# path, so its plain rate keeps the faster repacked weights.
NO_REPACK_NOTE = (
    "llama.cpp's repacked batch kernels crashed on this CPU: its forwards over several tokens ran unrepacked"
)


# Where its flash attention crashes over repacked weights (DeepSeek's latent attention: GGML_ASSERT(*cur_backend_id !=
# -1) in its scheduler, even decoding), the whole run goes with flash attention off, which is faster there than
# repacking off.
NO_FLASH_ATTENTION_NOTE = (
    "llama.cpp's flash attention crashed on this file: every llama.cpp row ran with it off (-fa off)"
)


@dataclass
class LlamaBench:
    decode_tokens_per_s: float  # tg: plain decoding
    forward_ms: dict[int, float]  # tokens in one forward -> ms (from pp)
    batches_repacked: bool = True
    flash_attention: bool = True

    def verify_cost_ratio(self, k: int) -> float | None:
        """T(k+1)/T(1): a verify over k drafts against one decoded token."""
        return self.forward_ms[k + 1] / self.forward_ms[1] if k + 1 in self.forward_ms else None

    def prefill_tokens_per_s(self, tokens: int) -> float | None:
        """ppN: one forward over an N-token prompt."""
        return 1000 * tokens / self.forward_ms[tokens] if tokens in self.forward_ms else None


@dataclass
class LlamaSpeculative:
    k: int
    output_tokens: int
    seconds: float
    drafted: int
    accepted: int
    repacked: bool = True

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


# What `bench quality --vs-llama-cpp` runs beyond build-llama-cpp.sh's targets.
EXTRA_TARGETS = ("llama-perplexity", "llama-tokenize")


def binary(bin_dir: str, name: str) -> str:
    folder = os.path.expanduser(bin_dir)
    path = os.path.join(folder, name)
    if not os.access(path, os.X_OK):
        if name in EXTRA_TARGETS and os.access(os.path.join(folder, "llama-bench"), os.X_OK):
            raise SpecDecodeError(
                f"no executable {name} in {bin_dir}: build-llama-cpp.sh does not build it; run "
                f"`cmake --build build --target {' '.join(EXTRA_TARGETS)}` in the folder above "
                "build/ to add it"
            )
        raise SpecDecodeError(
            f"no executable {name} in {bin_dir}; pass the folder that build-llama-cpp.sh "
            "printed (it holds llama-bench and llama-speculative-simple)"
        )
    return path


def run_llama_bench(
    bin_dir: str,
    gguf: str,
    threads: int,
    max_tokens: int,
    forward_sizes: tuple[int, ...] = (1, 2, 3, 5, 512),
    repeats: int = 3,
    warmup: bool = True,
) -> LlamaBench:
    """Without `warmup`, llama-bench times its first forward: worth it where one forward takes minutes (a long
    prompt), and its warm-up would double the run."""
    cmd = [binary(bin_dir, "llama-bench"), "-m", gguf, "-t", str(threads), "-r", str(repeats), "-o", "json"]
    cmd += [] if warmup else ["--no-warmup"]
    sizes = ",".join(map(str, forward_sizes))
    try:
        rows, repacked = _bench_rows(cmd, sizes, max_tokens)
        flash = True
    except LlamaCrashed:  # decoding crashed too
        (rows, repacked), flash = _bench_rows(cmd + ["-fa", "off"], sizes, max_tokens), False
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    forward_ms = {r["n_prompt"]: 1000 * r["n_prompt"] / r["avg_ts"] for r in rows if r["n_prompt"] > 0}
    return LlamaBench(tg, forward_ms, repacked, flash)


def _bench_rows(cmd: list[str], sizes: str, max_tokens: int) -> tuple[list[dict], bool]:
    """llama-bench's rows and whether its forwards over several tokens ran repacked: where they crash, decoding as it
    was and those forwards with repacking off (NO_REPACK_NOTE). Raises LlamaCrashed where decoding crashes too."""
    try:
        return json.loads(_run(cmd + ["-p", sizes, "-n", str(max_tokens)])), True
    except LlamaCrashed:
        rows = json.loads(_run(cmd + ["-p", "0", "-n", str(max_tokens)]))
    return rows + json.loads(_run(cmd + ["-p", sizes, "-n", "0", "--repack", "0"])), False


def run_llama_decode_at_depths(
    bin_dir: str, gguf: str, threads: int, tokens: int, depths: tuple[int, ...], repeats: int = 2
) -> tuple[dict[int, float], bool]:
    """llama-bench's plain decoding of `tokens` tokens after `depth` tokens already in its cache: tokens/s
    by depth, and whether the weights ran repacked. The cache is filled by a forward over `depth` tokens,
    which takes the repacked batch kernels; where those crash (see NO_REPACK_NOTE) the whole run goes
    unrepacked."""
    cmd = [
        binary(bin_dir, "llama-bench"),
        "-m",
        gguf,
        "-t",
        str(threads),
        "-r",
        str(repeats),
        "-o",
        "json",
        "-p",
        "0",
        "-n",
        str(tokens),
        "-d",
        ",".join(map(str, depths)),
    ]
    try:
        rows, repacked = json.loads(_run(cmd)), True
    except LlamaCrashed:
        rows, repacked = json.loads(_run(cmd + ["--repack", "0"])), False
    return {r["n_depth"]: r["avg_ts"] for r in rows if r["n_gen"] > 0}, repacked


def run_llama_speculative(
    bin_dir: str,
    target: str,
    draft: str | None,
    prompts: list[str],
    k: int,
    max_tokens: int,
    threads: int,
    context: int = 4096,
    spec_type: str = "draft-simple",
) -> LlamaSpeculative:
    """Greedy, EOS ignored, every prompt after the other (batch size 1); figures pooled over prompts. With
    an n-gram spec_type there is no draft model, and the mode drafts as its defaults say."""
    total = LlamaSpeculative(k, 0, 0.0, 0, 0)
    proposer = ["-md", draft, "--spec-draft-n-max", str(k), "-td", str(threads)] if draft else []
    no_repack: list[str] = []  # set for the rest of the prompts once a repacked run crashed
    for prompt in prompts:
        cmd = [
            binary(bin_dir, "llama-speculative-simple"),
            "-m",
            target,
            *proposer,
            "--spec-type",
            spec_type,
            "-t",
            str(threads),
            "-c",
            str(context),
            "-n",
            str(max_tokens),
            "--temp",
            "0",
            "--ignore-eos",
            "-p",
            prompt,
        ]
        try:
            log = _run(cmd + no_repack)
        except LlamaCrashed:
            if no_repack:
                raise
            no_repack = ["--no-repack"]
            log = _run(cmd + no_repack)
        decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
        drafted, accepted = re.search(r"n_drafted\s*=\s*(\d+)", log), re.search(r"n_accept\s*=\s*(\d+)", log)
        if not (decoded and drafted and accepted):
            raise SpecDecodeError(f"could not read llama-speculative-simple's statistics:\n{log[-2000:]}")
        total.output_tokens += int(decoded[1])
        total.seconds += float(decoded[2])
        total.drafted += int(drafted[1])
        total.accepted += int(accepted[1])
    total.repacked = not no_repack
    return total


def run_llama_tokenize(bin_dir: str, gguf: str, text_file: str) -> list[int]:
    """The file's token ids as llama.cpp's tokenizer for this GGUF gives them (with what its vocabulary
    adds, as llama-perplexity tokenizes)."""
    out = _run([binary(bin_dir, "llama-tokenize"), "-m", gguf, "-f", text_file, "--ids", "--log-disable"])
    found = re.findall(r"^\[[\d, ]*\]$", out, re.M)
    if not found:
        raise SpecDecodeError(f"could not read llama-tokenize's ids:\n{out[-2000:]}")
    return json.loads(found[-1])


def run_llama_perplexity(bin_dir: str, gguf: str, text_file: str, context: int, threads: int) -> float:
    """`llama-perplexity`'s final estimate over the file (chunks of `context`, second halves scored)."""
    log = _run(
        [
            binary(bin_dir, "llama-perplexity"),
            "-m",
            gguf,
            "-f",
            text_file,
            "-c",
            str(context),
            "-b",
            str(context),
            "-t",
            str(threads),
        ]
    )
    found = re.search(r"Final estimate: PPL = ([\d.]+)", log)
    if not found:
        raise SpecDecodeError(f"could not read llama-perplexity's estimate:\n{log[-2000:]}")
    return float(found[1])


def _run(cmd: list[str]) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if done.returncode < 0:
        raise LlamaCrashed(f"{os.path.basename(cmd[0])} died of signal {-done.returncode}:\n{done.stderr[-2000:]}")
    if done.returncode != 0:
        raise SpecDecodeError(f"{os.path.basename(cmd[0])} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return done.stdout + done.stderr
