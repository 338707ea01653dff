"""Quality of bf16 attention arithmetic (as AMX tiles would compute it: q*scale, k, v, and the softmax's
exponentials rounded to bf16, products summed in float32) against the float32 model, teacher-forced over
bench quality's held text; beside it the engine's float16-KV kernel. Weights float32 in all three. ROUND names
the operands rounded (q, k, p, v; default all); SKIP_F16 skips the kernel's run.

    ROUND=qkpv python docs/bench/attention-bf16-quality.py [MODEL] [TEXTS] [TOKENS]
"""
import os
import sys

import torch

from specdecode.bench.quality import evaluate, held_texts
from specdecode.models.loader import load_model, load_tokenizer
from specdecode.models import runtime

model_name = sys.argv[1] if len(sys.argv) > 1 else "qwen2.5-coder-1.5b"
num, max_len = int(sys.argv[2]) if len(sys.argv) > 2 else 16, int(sys.argv[3]) if len(sys.argv) > 3 else 256
tok = load_tokenizer(model_name)
texts = [tok.encode(t)[:max_len] for t in held_texts(num)]

ref = load_model(model_name, "cpu", "float32", quantization="none", kv_cache_dtype="float32").model
_, ppl, reference = evaluate(ref, texts, None)
print(f"float32 reference: ppl {ppl:.4f}  ({sum(len(t) - 1 for t in texts)} tokens)", flush=True)

if "SKIP_F16" not in os.environ:
    f16 = load_model(model_name, "cpu", "float32", quantization="none", kv_cache_dtype="float16").model
    agree, ppl, _ = evaluate(f16, texts, reference)
    print(f"float16 KV, the engine's kernel: top-1 {agree:.2%} ppl {ppl:.4f}", flush=True)
    del f16


ROUND = os.environ.get("ROUND", "qkpv")


def bf(x, what):
    return x.to(torch.bfloat16).float() if what in ROUND else x


def bf16_forward(self, x, rope, batch, cache):
    """The batched path (no attention kernel attached, as below), its operands rounded as ROUND says."""
    if batch.rowwise is not None:
        raise RuntimeError("expected the batched attention path: the kernel is detached, so calls are not row by row")
    bsz, width, _ = x.shape
    q, k, v = self._heads(x, rope)
    batch.store(cache, self.layer, k, v)
    keys, values = batch.load(cache, self.layer)
    g = self.num_heads // self.num_kv_heads
    kk = bf(keys.float(), "k").repeat_interleave(g, 1)
    vv = bf(values.float(), "v").repeat_interleave(g, 1)
    s = bf(q * self.scale, "q") @ kk.transpose(-1, -2)
    s = s.masked_fill(~batch.mask_for(self.window), float("-inf"))
    e = torch.exp(s - s.amax(-1, keepdim=True))
    out = (bf(e, "p") @ vv) / e.sum(-1, keepdim=True)
    return self.o_proj(out.transpose(1, 2).reshape(bsz, width, -1))


m = load_model(model_name, "cpu", "float32", quantization="none", kv_cache_dtype="float16").model
for layer in m.layers:
    layer.self_attn.rowwise_kernel = None
runtime.Attention.forward = bf16_forward
agree, ppl, _ = evaluate(m, texts, reference)
print(f"bf16 rounding of {ROUND} (KV float16): top-1 {agree:.2%} ppl {ppl:.4f}", flush=True)
