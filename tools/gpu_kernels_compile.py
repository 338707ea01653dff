"""Compile the GPU's Triton kernels (executor/paged_attention.py, gemv.py, qkv_epilogue.py, grouped_experts.py) for a
GPU this machine need not have: Hopper (the H100 and H200, sm_90) unless --arch says otherwise, down to the machine code
ptxas makes (Triton's wheel carries it). A mistake the interpreter lets through (a type that differs between branches, a
shape `tl.dot` refuses) fails here, without a lent GPU, and so does a launch needing more shared memory than the device
kind's programs may have (start-up would pass that kernel over: executor/cuda_graphs.UNFIT_KERNEL).

The launches are those of representative forwards (decode, verify, a KV head's group a program, spans of several KV
blocks, a 4,160-key context in splits, Gemma 3's head size), a mixture of experts' calls and the 1.5B's QKV projection
at every configuration of the linear layers' kernel (and with the norm or SwiGLU taken in, RoPE and the cache write,
float32 logits), each typed from its own arguments: the callers run on CPU tensors with the kernels swapped for
recorders. Run it without TRITON_INTERPRET (the interpreter's kernels do not compile).

    python tools/gpu_kernels_compile.py [--arch 90] [--dtype bfloat16]
"""

import argparse
import sys
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from specdecode.config import ModelConfig  # noqa: E402
from specdecode.executor import gemv, grouped_experts, paged_attention, qkv_epilogue  # noqa: E402
from specdecode.executor.cuda_graphs import Bucket, StaticBatch  # noqa: E402
from specdecode.kv_cache import KVCache  # noqa: E402
from specdecode.models.layers import SparseMoE  # noqa: E402

KERNELS = {
    paged_attention: ("_rotate_and_store", "_attend", "_combine"),
    gemv: ("_gemv", "_sum_splits"),
    qkv_epilogue: ("_projected", "_merged"),
    grouped_experts: ("_routed", "_experts_matmul", "_count_pairs", "_place_pairs", "_sum_experts"),
}
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32"}
# heads, KV heads, head size, sequences, rows each, cached tokens, query heads a program, keys a program takes at a time
FORWARDS = {
    "1.5B decode": (12, 2, 128, 1, 1, 200, 1, 64),
    "1.5B decode, spans of 256 keys (4 blocks)": (12, 2, 128, 1, 1, 200, 1, 256),
    "1.5B verify of 5, a KV head's group a program": (12, 2, 128, 1, 5, 200, None, 64),
    "1.5B 64 sequences": (12, 2, 128, 64, 1, 200, 1, 64),
    "1.5B decode after 4,096 tokens (splits)": (12, 2, 128, 1, 1, 4096, 1, 64),
    "Gemma 3 270M verify (head size 256)": (4, 1, 256, 1, 4, 200, 1, 64),
}


# shared memory a program may have (bytes, opt-in maximum) by compute capability, from CUDA's programming guide: a
# launch needing more is refused at run time (Triton's OutOfResources), which start-up meets by passing that kernel over
SHARED_MEMORY = {75: 65536, 80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
LAUNCH_OPTIONS = ("num_warps", "num_stages")  # a launch's keywords that are not the kernel's arguments
SHOWN = ("R", "HEADS", "D", "KEYS", "SPLITS", "BLOCK_M", "BLOCK_N", "BLOCK_K")  # constants printed


class Recorder:
    """Stands for a kernel: records each launch's arguments instead of running it."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **constants: self.launches.append((args, constants))


def launches(dtype) -> dict[str, list]:
    recorders = {name: Recorder() for names in KERNELS.values() for name in names}
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, recorders[name])
    for heads, kv_heads, dim, seqs, rows, cached, per_program, span in FORWARDS.values():
        cfg = ModelConfig("llama", 1, heads * dim, 1, 1, heads, kv_heads, head_dim=dim)
        cache = KVCache(cfg, seqs, cached + 64, dtype, "cpu", scratch=True)
        bucket = Bucket(seqs, rows, cache.max_blocks * cache.block_size)
        batch = StaticBatch(bucket, "cpu")
        q, k, v = (torch.zeros(seqs, rows, h, dim, dtype=dtype) for h in (heads, kv_heads, kv_heads))
        rope = (torch.zeros(seqs, 1, rows, dim, dtype=dtype),) * 2
        paged_attention.PagedAttention(per_program, span)(batch, cache, 0, q, k, v, rope, None, dim**-0.5)
    x, weight, bias = torch.zeros(gemv.MAX_ROWS, 1536, dtype=dtype), torch.zeros(2048, 1536, dtype=dtype), None
    for config in gemv.CONFIGS:
        gemv.gemv(x, weight, torch.zeros(2048, dtype=dtype), config)
        qkv_epilogue.projected(x, weight, torch.zeros(2048, dtype=dtype), config, store=_rope_store(dtype))
    for config in (gemv.CONFIGS[0], gemv.CONFIGS[-1]):  # the norm (residual added) and SwiGLU taken in, K split or not
        gemv.gemv(x, weight, bias, config, (torch.zeros(1536, dtype=dtype), 1e-6), x, torch.zeros_like(x))
        gemv.gemv(torch.zeros(gemv.MAX_ROWS, 2 * 1536, dtype=dtype), weight, bias, config, activated=True)
        gemv.gemv(x, weight, bias, config, (torch.zeros(1536, dtype=dtype), 1e-6), out_dtype=torch.float32)  # logits
    _mixture_of_experts(dtype)
    return {name: recorder.launches for name, recorder in recorders.items()}


def _mixture_of_experts(dtype) -> None:
    """Qwen3-30B-A3B's experts (128, top 8; narrower layers: the shapes are not constants) at a decode, a verify of 5,
    64 sequences and a 2,048-token prompt chunk; GeGLU too."""
    for activation in ("silu", "gelu_tanh"):
        cfg = ModelConfig("qwen3_moe", 1, 256, 64, 1, 2, 1, num_experts=128, experts_per_token=8, activation=activation)
        moe = SparseMoE(cfg).to(dtype)
        kernel = grouped_experts.GroupedExperts(moe)
        for rows in (1, 5, 64, 2048) if activation == "silu" else (5,):
            kernel(moe, torch.zeros(rows, 256, dtype=dtype))


def _rope_store(dtype) -> qkv_epilogue.RopeStore:
    """Where the 1.5B's QKV projection with RoPE and the cache write in puts a decode's rows."""
    cache = KVCache(ModelConfig("llama", 1, 1536, 1, 1, 12, 2, head_dim=128), 1, 256, dtype, "cpu", scratch=True)
    rows = torch.zeros(gemv.MAX_ROWS, dtype=torch.long)
    tables = (torch.zeros(gemv.MAX_ROWS, 128, dtype=dtype),) * 2
    return qkv_epilogue.RopeStore(*tables, rows, rows, cache.table, cache.k[0], cache.v[0], 12, 2)


def signature(fn, args, constants) -> ASTSource:
    def typed(arg):
        if isinstance(arg, torch.Tensor):
            return "*" + TYPES[arg.dtype]
        return "fp32" if isinstance(arg, float) else "i32"

    constants = {**constants, **{name: None for name, arg in zip(fn.arg_names, args) if arg is None}}
    types = {name: typed(arg) for name, arg in zip(fn.arg_names, args) if arg is not None}
    types.update(dict.fromkeys(constants, "constexpr"))
    constexprs = {(fn.arg_names.index(k),): v for k, v in constants.items()}
    return ASTSource(fn, types, constexprs, aligned(fn, args))


def aligned(fn, args) -> dict:
    """What a launch tells the compiler as Triton's JIT does: pointers and integers that are multiples of 16 (an integer
    the kernel does not specialise on aside). Loads are vectorised, and loops pipelined, on what it knows."""
    unspecialised = {fn.arg_names[i] if isinstance(i, int) else i for i in fn.do_not_specialize}
    attrs = {}
    for i, (name, arg) in enumerate(zip(fn.arg_names, args)):
        if isinstance(arg, torch.Tensor):
            sixteen = arg.data_ptr() % 16 == 0
        else:
            sixteen = isinstance(arg, int) and not isinstance(arg, bool) and arg % 16 == 0 and name not in unspecialised
        if sixteen:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="the CUDA compute capability, as a number (90: Hopper)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    if triton.knobs.runtime.interpret:
        sys.exit("TRITON_INTERPRET is set: the interpreter's kernels do not compile; run without it")
    kernels = {name: getattr(module, name) for module, names in KERNELS.items() for name in names}
    target, limit, too_large = GPUTarget("cuda", args.arch, 32), SHARED_MEMORY.get(args.arch), 0
    for name, calls in launches(getattr(torch, args.dtype)).items():
        for call_args, constants in calls:
            options = {key: constants.pop(key) for key in LAUNCH_OPTIONS if key in constants}
            compiled = triton.compile(signature(kernels[name], call_args, constants), target=target, options=options)
            assert compiled.asm.get("cubin"), f"{name}: no machine code"
            shown = {k: v for k, v in constants.items() if k in SHOWN}
            shared = compiled.metadata.shared
            over = limit is not None and shared > limit
            too_large += over
            print(f"{name:18s} {shown}: {shared} B shared{' (too much)' if over else ''}, "
                  f"{compiled.metadata.num_warps} warps")  # fmt: skip
    print(f"every launch compiled for sm_{args.arch} ({args.dtype})")
    if limit is None:
        print(f"shared memory not checked: sm_{args.arch}'s limit is not in this tool's table")
        return 0
    print(f"{too_large} launches need more than sm_{args.arch}'s {limit} B of shared memory a program")
    return 1 if too_large else 0


if __name__ == "__main__":
    sys.exit(main())
