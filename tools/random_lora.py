"""Write a random LoRA adapter (PEFT's files) for a model's shapes, to time adapters on real weights: every attention
and MLP projection of every layer at the given rank, B small enough that the model still writes sensible code.

python tools/random_lora.py --model qwen2.5-coder-1.5b --rank 16 --out /tmp/lora16
specdecode bench latency --lora /tmp/lora16 --no-ngram --head head:qwen2.5-coder-1.5b -k 3 --draft-confidence 0.8
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from safetensors.torch import save_file

from specdecode.models.families import from_gguf
from specdecode.models.gguf_loader import MappedReader
from specdecode.models.sources import resolve

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shapes(cfg) -> dict[str, tuple[int, int]]:
    """(in, out) of each adapted projection, by its Hugging Face name within a layer."""
    q, kv = cfg.num_heads * cfg.dim_per_head, cfg.num_kv_heads * cfg.dim_per_head
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    return {
        "self_attn.q_proj": (hidden, q),
        "self_attn.k_proj": (hidden, kv),
        "self_attn.v_proj": (hidden, kv),
        "self_attn.o_proj": (q, hidden),
        "mlp.gate_proj": (hidden, inter),
        "mlp.up_proj": (hidden, inter),
        "mlp.down_proj": (inter, hidden),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-1.5b", help="a bundled name or a .gguf file")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--b-scale", type=float, default=0.002, help="B's entries' standard deviation")
    parser.add_argument("--seed", type=int, default=0, help="another seed, another adapter of the same shapes")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"], help="as saved")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    cfg = from_gguf(MappedReader(resolve(args.model).path))
    g, tensors = torch.Generator().manual_seed(args.seed), {}
    for layer in range(cfg.num_layers):
        for name, (inputs, outputs) in shapes(cfg).items():
            key = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(args.rank, inputs, generator=g) / inputs**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(outputs, args.rank, generator=g) * args.b_scale
    os.makedirs(args.out, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    save_file({k: t.to(dtype) for k, t in tensors.items()}, os.path.join(args.out, "adapter_model.safetensors"))
    settings = {"peft_type": "LORA", "r": args.rank, "lora_alpha": 2 * args.rank, "target_modules": list(TARGETS)}
    json.dump(settings | {"bias": "none"}, open(os.path.join(args.out, "adapter_config.json"), "w"))
    print(f"{sum(t.numel() for t in tensors.values()) / 1e6:.1f}M parameters in {args.out}")


if __name__ == "__main__":
    main()
