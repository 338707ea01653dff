"""`specdecode bench transformers`: the batch-1 HumanEval latency measurement of `bench latency`, through
Hugging Face transformers on the same weights and machine: plain `generate`, assisted generation with the
draft as `assistant_model`, and prompt lookup (`prompt_lookup_num_tokens`).

The models are built from the very tensors specdecode runs (the GGUF dequantized by our loader), so
the two engines differ only in how they decode. Greedy, EOS ignored (min_new_tokens = max_new_tokens),
every output compared with transformers' own plain decoding."""

from __future__ import annotations

import time

import torch

from ..errors import SpecDecodeError
from ..models.families import llama_config_fields
from .datasets import humaneval_prompts
from .formatting import ratio
from .results import command_line, describe_machine, machine_info, write_json


def hf_causal_lm(name: str, dtype: torch.dtype):
    """A transformers Llama/Qwen2 model holding the weights specdecode loads for `name`."""
    from ..models.loader import load_weights

    cfg, tensors = load_weights(name, dtype)
    return hf_model_from(cfg, tensors, dtype, name)


def hf_model_from(cfg, tensors: dict[str, torch.Tensor], dtype: torch.dtype, name: str = "model"):
    try:
        from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    except ImportError:
        raise SpecDecodeError("the baseline needs transformers: pip install transformers") from None
    if not cfg.is_llama_or_qwen2:
        raise SpecDecodeError(
            f"{name}: the transformers baseline rebuilds Llama and Qwen2 models only; this is a "
            f"{cfg.arch} model (run the baseline on a Llama- or Qwen2-family target)"
        )
    tensors = {k: v.to(dtype) for k, v in tensors.items()}
    config_cls, model_cls = (Qwen2Config, Qwen2ForCausalLM) if cfg.arch == "qwen2" else (LlamaConfig, LlamaForCausalLM)
    config = config_cls(
        **llama_config_fields(cfg),
        tie_word_embeddings="lm_head.weight" not in tensors,
        head_dim=cfg.dim_per_head,
        torch_dtype=dtype,
    )
    with torch.device("meta"):
        model = model_cls(config)
    missing, unexpected = model.load_state_dict(tensors, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise SpecDecodeError(
            f"{name}: weights do not match the transformers model "
            f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    model.tie_weights()
    # the rotary frequencies are a computed buffer, not a weight: build them for real
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
    return model.eval()


def run_hf_config(model, prompts: list[list[int]], max_tokens: int, **extra) -> tuple[dict, list[list[int]]]:
    """Greedy generation of each prompt alone; tokens/s over the whole run."""
    outputs = []
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), max_new_tokens=4, do_sample=False, **extra)  # warm-up
        start = time.perf_counter()
        for ids in prompts:
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                **extra,
            )
            outputs.append(out[0, len(ids) :].tolist())
        seconds = time.perf_counter() - start
    tokens = sum(len(o) for o in outputs)
    return {"output_tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}, outputs


def run_hf_baseline(args) -> list[dict]:
    from ..models.loader import load_tokenizer

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    tokenizer = load_tokenizer(args.model)
    prompts = [tokenizer.encode(p) for p in humaneval_prompts(args.num_prompts)]
    target = hf_causal_lm(args.model, dtype)
    configs = [("transformers plain", "none", 0, {})]
    if args.draft:
        assistant = hf_causal_lm(args.draft, dtype)
        # the draft proposes exactly k tokens per step, as in specdecode's fixed policy
        assistant.generation_config.num_assistant_tokens = args.k
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        configs.append((f"transformers assisted k={args.k}", args.draft, args.k, {"assistant_model": assistant}))
    configs.append((f"transformers prompt-lookup k={args.k}", "ngram", args.k, {"prompt_lookup_num_tokens": args.k}))
    rows, plain_outputs = [], None
    for label, proposer, k, extra in configs:
        stats, outputs = run_hf_config(target, prompts, args.max_tokens, **extra)
        plain_outputs = plain_outputs or outputs
        row = {
            "config": label,
            "proposer": proposer,
            "k": k,
            **stats,
            "speedup": stats["tokens_per_s"] / rows[0]["tokens_per_s"] if rows else 1.0,
            "identical_to_plain": outputs == plain_outputs if rows else None,
        }
        rows.append(row)
        print(
            f"{label:<34}{row['tokens_per_s']:>8.2f} tok/s{ratio(row['speedup'], 8)}  "
            f"identical: {'-' if row['identical_to_plain'] is None else row['identical_to_plain']}",
            flush=True,
        )
    return rows


def run_hf_baseline_cli(args) -> int:
    import transformers

    machine = machine_info()
    print(
        f"transformers {transformers.__version__}, HumanEval, batch 1, greedy, {args.max_tokens} new tokens, "
        f"{args.num_prompts} prompts, {args.dtype}; {describe_machine(machine)}",
        flush=True,
    )
    rows = run_hf_baseline(args)
    meta = {
        "kind": "baseline",
        "command": command_line(),
        "model": args.model,
        "draft": args.draft,
        "k": args.k,
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "transformers": transformers.__version__,
        "machine": machine,
    }
    write_json(args.out, {"meta": meta, "results": rows})
    return 0
