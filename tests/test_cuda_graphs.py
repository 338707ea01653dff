"""Decode and verify forwards at bucket shapes (the forwards CUDA graphs replay): which bucket a forward takes, the
fixed-shape forward against the eager one (logits, hidden states, KV entries), padding kept out of every
sequence's cache, the eager fallback, a drafter's greedy rounds chained, and greedy speculation through the
engine. On a CPU they run without capture; with SPECDECODE_TEST_DEVICE=cuda, captured and replayed."""

import pytest
import torch
from conftest import DEVICE, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

from specdecode import LLM, SamplingParams
from specdecode.executor import cuda_graphs
from specdecode.executor import runner as runner_module
from specdecode.executor.cuda_graphs import Bucket, bucket_for
from specdecode.executor.runner import ModelRunner
from specdecode.models.layers import apply_rope

# the fixed-shape forward sums attention over padded key ranges: the same values, rounded otherwise
ATOL = 1e-4 if DEVICE == "cpu" else 2e-2


def test_buckets_round_sequences_rows_and_keys_up():
    assert bucket_for([1], 10, 4096) == Bucket(1, 1, 256)
    assert bucket_for([1], 10, 4096, logits="last") == Bucket(1, 1, 256)  # a decode's one row: one bucket either way
    assert bucket_for([20, 7], 10, 4096, logits="last") == Bucket(2, 32, 256, last_logits=True)
    assert bucket_for([5, 1, 2], 300, 4096) == Bucket(4, 8, 512)
    assert bucket_for([1] * 9, 1000, 4096) == Bucket(16, 1, 1024)
    assert bucket_for([1], 600, 640) == Bucket(1, 1, 640)  # K stops at what a block table reaches


def test_forwards_outside_every_bucket_run_eagerly():
    assert bucket_for([65], 100, 4096) is None  # a prompt: wider than any verify
    assert bucket_for([1] * 300, 100, 4096) is None  # more sequences than the largest bucket
    assert bucket_for([8] * 200, 100, 4096) is None  # more rows than the largest verify call
    assert bucket_for([1] * 64, 8000, 8192) is None  # too many keys to gather a step


def _steps():
    """(inputs per sequence) for a prefill, decodes and verifies of several widths, over two sequences."""
    gen = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(0, 60, (n,), generator=gen).tolist()

    return [
        [tokens(20), tokens(7)],
        [tokens(1), tokens(1)],
        [tokens(4), tokens(1)],
        [tokens(3), tokens(6)],
        [tokens(1), tokens(2)],
    ]


class _Rerun:
    """A CUDA graph's contract, kept on a CPU: a replay redoes the captured work and leaves its results in the
    tensors the capture returned (a replay's outputs are the capture's, overwritten)."""

    def __init__(self, run, outputs):
        self.run, self.outputs = run, outputs

    @torch.inference_mode()
    def replay(self):
        for kept, fresh in zip(_tensors(self.outputs), _tensors(self.run())):
            kept.copy_(fresh)


def _tensors(out) -> list[torch.Tensor]:
    return [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]


@pytest.fixture
def captured(monkeypatch):
    """Fixed-shape forwards and chained rounds taken through their capture path: on a CPU with a stand-in for the
    graph (_Rerun), on a GPU with real graphs."""
    if DEVICE == "cuda":
        return
    init = cuda_graphs.BucketedForward.__init__

    def capturing(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.capture = True

    def capture_graph(self, batch, run):
        batch.fill([], [], [], self.cache.scratch_row)
        outputs = run()
        return _Rerun(run, outputs), outputs

    monkeypatch.setattr(cuda_graphs.BucketedForward, "__init__", capturing)
    monkeypatch.setattr(cuda_graphs.BucketedForward, "capture_graph", capture_graph)


def _run(runner, model_steps, logits="all", hidden="all"):
    slots = [runner.allocate(), runner.allocate()]
    outs = []
    for inputs in model_steps:
        out = runner.forward(slots, inputs, logits, hidden=hidden)
        outs.append(out)
        for slot, new in zip(slots, inputs):
            runner.commit(slot, runner.length(slot) + len(new) - (len(new) > 2))  # a rejected draft now and then
    return outs, slots


@pytest.mark.parametrize("features", [{}, {"sliding_window": 5, "qk_norm": True}], ids=["qwen2", "window+qk-norm"])
def test_the_fixed_shape_forward_computes_the_eager_one(features):
    model = tiny_model(seed=3, **features).model
    eager = ModelRunner(model, 3, 600, fixed_shapes=False)
    fixed = ModelRunner(model, 3, 600, fixed_shapes=True)
    expected, slots = _run(eager, _steps())
    got, _ = _run(fixed, _steps())
    assert {b.rows for b in fixed._fixed.buckets} == {32, 1, 4, 8, 2}  # the 20-token prefill in a bucket too
    for want, out in zip(expected, got):
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
    for slot in slots:  # the caches hold the same entries, padding nowhere among them
        n = fixed.length(slot)
        for layer in range(model.cfg.num_layers):
            torch.testing.assert_close(
                fixed._cache.keys(layer, slot, n), eager._cache.keys(layer, slot, n), atol=ATOL, rtol=0
            )


def test_replayed_forwards_compute_the_eager_ones(captured):
    model = tiny_model(seed=3).model
    expected, _ = _run(ModelRunner(model, 3, 600, fixed_shapes=False), _steps())
    fixed = ModelRunner(model, 3, 600, fixed_shapes=True)
    got, _ = _run(fixed, _steps())
    assert all(entry.graph is not None for entry in fixed._fixed._entries.values())
    for want, out in zip(expected, got):
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("broken", [False, True], ids=["each sequence's last row", "each sequence's first row"])
def test_prompts_at_bucket_shapes_take_the_lm_head_at_their_last_rows_alone(captured, broken, monkeypatch):
    """Prompts (each sequence's last row's logits asked for) run in a bucket of their own whose graph keeps one row of
    logits a sequence, not one a row (a 1,024-row prompt bucket of the 1.5B would keep 622 MB), and every row's hidden
    state: the logits and hidden states eager forwards give. Read at each sequence's first row (the deliberately
    broken variant), they differ."""
    if broken:
        fill = cuda_graphs.StaticBatch.fill

        def at_first_rows(self, slots, starts, inputs, *args, **kwargs):
            fill(self, slots, starts, inputs, *args, **kwargs)
            if self.logit_rows is not None:
                self.logit_rows.copy_(torch.arange(len(self.logit_rows)) * self.bucket.rows)

        monkeypatch.setattr(cuda_graphs.StaticBatch, "fill", at_first_rows)
    model = tiny_model(seed=3).model
    prompts = [_steps()[0], _steps()[3]]  # 20 and 7 tokens, then 3 and 6
    expected, _ = _run(ModelRunner(model, 3, 600, fixed_shapes=False), prompts, logits="last")
    fixed = ModelRunner(model, 3, 600, fixed_shapes=True)
    got, _ = _run(fixed, prompts, logits="last")
    entries = fixed._fixed._entries
    assert {b for b in entries if b.last_logits} == {Bucket(2, 32, 256, True), Bucket(2, 8, 256, True)}
    assert all(entry.outputs[0].shape[0] == 2 for entry in entries.values())  # a logits row a sequence
    same = [torch.allclose(out[0], want[0], atol=ATOL, rtol=0) for want, out in zip(expected, got)]
    assert all(same) != broken
    for want, out in zip(expected, got):
        torch.testing.assert_close(out[1], want[1], atol=ATOL, rtol=0)  # every row's hidden state


@pytest.mark.parametrize("graphs_kept", [1, 2])
def test_captured_graphs_keep_their_outputs_within_a_bound(captured, graphs_kept):
    """Each captured graph keeps its outputs (every row's logits and hidden state): past `kept_bytes` the least
    recently replayed graphs are let go, captured again when met again, so a server meeting many shapes holds a
    bounded amount; the forwards compute what eager ones do throughout."""
    model = tiny_model(seed=3).model
    expected, _ = _run(ModelRunner(model, 3, 600, fixed_shapes=False), _steps())
    fixed = ModelRunner(model, 3, 600, fixed_shapes=True)
    forward = fixed._fixed
    row = 4 * model.cfg.vocab_size + model.cfg.hidden_size * model.dtype.itemsize
    forward.kept_bytes = graphs_kept * 32 * row  # the outputs of this many buckets of up to 32 rows
    got, _ = _run(fixed, _steps())
    for want, out in zip(expected, got):
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
    held = sum(cuda_graphs._bytes(entry.outputs) for entry in forward._entries.values())
    assert forward._held == held <= forward.kept_bytes and forward.let_go > 0


def test_the_graphs_let_go_are_the_least_recently_replayed(captured):
    """Three sequences at contexts of three key buckets, room for two graphs' outputs: decoding A, B, A, C lets B go
    (A was replayed since), not A."""
    model = tiny_model(seed=3, max_position=1024).model
    runner = ModelRunner(model, 3, 1024, fixed_shapes=True)
    forward = runner._fixed
    forward.kept_bytes = 2 * (4 * model.cfg.vocab_size + model.cfg.hidden_size * model.dtype.itemsize)
    slots = [runner.allocate() for _ in range(3)]
    for slot, length in zip(slots, (100, 300, 600)):
        runner.forward([slot], [[(7 * i) % 60 + 1 for i in range(length)]], "last")
        runner.commit(slot, length)
    for slot in (slots[0], slots[1], slots[0], slots[2]):
        runner.forward([slot], [[5]], "last")
    assert [bucket.keys for bucket in forward.buckets] == [256, 1024] and forward.let_go == 1


def test_the_last_rows_and_their_hidden_states():
    model = tiny_model(seed=4).model
    eager, fixed = ModelRunner(model, 2, 256, fixed_shapes=False), ModelRunner(model, 2, 256, fixed_shapes=True)
    for want, got in zip(_run(eager, _steps(), "last", True)[0], _run(fixed, _steps(), "last", True)[0]):
        assert got[0].shape == want[0].shape == (2, model.cfg.vocab_size)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_padding_written_into_a_real_slot_is_caught(monkeypatch):
    """The deliberately broken variant: padding rows aimed at slot 0 instead of the scratch block."""
    model = tiny_model(seed=3).model
    expected, _ = _run(ModelRunner(model, 3, 600, fixed_shapes=False), _steps())
    fill = cuda_graphs.StaticBatch.fill
    monkeypatch.setattr(
        cuda_graphs.StaticBatch,
        "fill",
        lambda self, slots, starts, inputs, scratch, *rest: fill(self, slots, starts, inputs, 0, *rest),
    )
    got, _ = _run(ModelRunner(model, 3, 600, fixed_shapes=True), _steps())
    assert any(not torch.allclose(g[0], e[0], atol=ATOL, rtol=0) for g, e in zip(got, expected))


def test_a_forward_outside_the_buckets_runs_eagerly():
    model = tiny_model(seed=5).model
    fixed, eager = ModelRunner(model, 1, 256, fixed_shapes=True), ModelRunner(model, 1, 256, fixed_shapes=False)
    prompt = list(range(1, 61)) * 2  # 120 tokens: wider than any verify call
    outs = [r.forward([r.allocate()], [prompt], "last") for r in (fixed, eager)]
    assert fixed._fixed.buckets == []
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)


@pytest.mark.parametrize("confidence", [0.0, 0.8])
def test_greedy_speculation_with_fixed_shapes_is_plain_decoding(monkeypatch, confidence):
    """The engine with every runner at bucket shapes (target and draft): speculative greedy output is the target's
    own greedy output, decoded eagerly. The draft model chains its rounds where it has no confidence stop."""
    prompts = [[5, 9, 14, 3, 22, 7], [40, 41, 42], list(range(10, 40))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def outputs(fixed: bool, k: int):
        monkeypatch.setattr(runner_module, "fixed_shapes_by_default", lambda model: fixed)
        target, draft = tiny_model(seed=0), tiny_model(seed=0, layers=1)
        llm = LLM(
            target=target,
            draft=draft if k else None,
            num_speculative_tokens=k,
            max_model_len=256,
            speculation_policy="fixed",
            draft_confidence=confidence,
            progress=False,
        )
        assert (llm.engine.runner._fixed is not None) == fixed
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if k and fixed:
            assert bool(llm.engine.proposer.runner._rounds._chains) == (confidence == 0.0)
        return outs

    assert outputs(True, 3) == outputs(False, 0)


@pytest.mark.parametrize("eager", [True, False])
def test_enforce_eager_keeps_graphs_off(eager):
    target = tiny_model(seed=0)
    llm = LLM(target=target, max_model_len=64, enforce_eager=eager, progress=False)
    assert target.model.capture_graphs is not eager
    assert (llm.engine.runner._fixed is not None) == (DEVICE == "cuda" and not eager)


def test_fused_elementwise_steps_compute_what_eager_ones_do():
    """The GPU's compiled norms, RoPE and SwiGLU (compiled for the CPU here) against the eager model."""
    model = tiny_model(seed=6, qk_norm=True).model
    expected, _ = _run(ModelRunner(model, 3, 256, fixed_shapes=False), _steps())
    assert cuda_graphs.fuse_elementwise(model)
    assert model.layers[0].self_attn.rope_kernel is not apply_rope and model.rotary.kernel is not None
    got, _ = _run(ModelRunner(model, 3, 256, fixed_shapes=True), _steps())
    for want, out in zip(expected, got):
        torch.testing.assert_close(out, want, atol=ATOL, rtol=0)


def test_eager_forwards_leave_the_compiled_kernels_alone():
    """A prompt's eager forward, at shapes no bucket has, takes the eager kernels: compiling for each new prompt
    shape would cost more than the kernel saves, and past the compiler's recompile limit graphs captured later
    would be left unfused."""
    model = tiny_model(seed=7).model
    assert cuda_graphs.fuse_elementwise(model)
    calls, kernels = [], set()
    for module in model.modules():
        for kernel in (
            getattr(module, "kernel", None),
            getattr(module, "act_mul_kernel", None),
            getattr(module, "rope_kernel", None),
        ):
            kernels.update(
                k
                for k in (kernel, getattr(kernel, "norm", None), getattr(kernel, "add_norm", None))
                if isinstance(k, cuda_graphs._InFixedShapes)
            )
    for kernel in kernels:
        kernel.compiled = _counted(kernel.compiled, calls)
    runner = ModelRunner(model, 2, 256, fixed_shapes=True)
    slot = runner.allocate()
    runner.forward([slot], [[i % 50 for i in range(80)]], "last")  # a prompt wider than any bucket: eager
    assert not calls
    runner.forward([slot], [[8]], "last")  # a decode: fixed shapes, compiled kernels
    assert calls


def _counted(fn, calls: list):
    def counted(*args):
        calls.append(fn)
        return fn(*args)

    return counted


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the check itself is run, at full shapes")
def test_the_prepared_gpu_check_runs_through_at_tiny_shapes(tmp_path):
    """tools/cuda_check.py --quick, the one run a lent GPU gets, at tiny shapes on this CPU: every section runs (a
    section that raises is listed as failed and the run goes on, which on a GPU would cost its minutes), and each
    leaves its figures."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tool = Path(__file__).resolve().parents[1] / "tools" / "cuda_check.py"
    env = {**os.environ, "SMOKE": "1", "PYTHONPATH": str(tool.parents[1] / "src")}
    command = [sys.executable, str(tool), "--quick", "--skip-tests", "--sweep-tokens", "8", "--out", str(tmp_path)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((tmp_path / "cuda-check.json").read_text())
    assert "failed" not in results, proc.stdout[-3000:] + proc.stderr[-3000:]
    sections = {"step_costs", "head_step", "measured_acceptance", "engine_trace", "concurrency", "greedy_bits"}
    sections |= {"prompts_together", "packed_eager", "experts", "draft_step_costs", "verify_widths"}
    assert sections <= set(results)
    assert [n for n in (1, 2, 4, 8, 16, 32, 64) if str(n) in results["concurrency"]] == [1, 2, 4, 8, 16, 32, 64]
    assert all(results["concurrency"]["1"][way]["decode_tok_s"] > 0 for way in ("adaptive", "imposed, head"))
    assert results["engine_trace"]["unprofiled_ms"] > 0 and results["engine_trace"]["head"]["steps"] > 0
    assert {choice: row["of"] for choice, row in results["greedy_bits"].items()} == {"auto": 4, "triton": 4}
    assert results["measured_acceptance"]["head, adaptive"]["decode_tok_s"] > 0
    assert results["measured_acceptance"]["head, adaptive"]["phases"]["steps"] > 0  # where a step's time went
    assert all(row["together_s"] > 0 and row["one_each_s"] > 0 for row in results["prompts_together"].values())
    compared = [*results["packed_eager"].values(), *results["experts"].values()]
    assert compared and all(row["max_logit_apart"] < 1e-4 for row in compared)


def test_the_prepared_gpu_checks_test_files_come_to_a_verdict(tmp_path, monkeypatch):
    """The check's last section runs test files in a pytest of their own, within what is left of the run: a passing
    file passes it, a failing one marks it failed (the run goes on)."""
    import time
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    import cuda_check

    monkeypatch.setattr(cuda_check, "RESULTS", {})
    monkeypatch.delenv("CHECK_OUT", raising=False)
    (tmp_path / "test_passes.py").write_text("def test_passes():\n    assert 1 + 1 == 2\n")
    (tmp_path / "test_fails.py").write_text("def test_fails():\n    assert 1 + 1 == 3\n")
    cuda_check.tests([str(tmp_path / "test_passes.py")], deadline=time.perf_counter() + 120)
    assert cuda_check.RESULTS["tests"]["rc"] == 0 and "failed" not in cuda_check.RESULTS
    assert cuda_check.RESULTS["tests"]["outcomes"] == {"PASSED": 1}
    both = [str(tmp_path / "test_fails.py"), str(tmp_path / "test_passes.py")]
    cuda_check.tests(both, deadline=time.perf_counter() + 120)
    assert cuda_check.RESULTS["tests"]["rc"] == 1
    assert cuda_check.RESULTS["tests"]["outcomes"] == {"PASSED": 1, "FAILED": 1}
    assert [test.rsplit("/", 1)[-1] for test in cuda_check.RESULTS["tests"]["failed"]] == ["test_fails.py::test_fails"]
    assert cuda_check.RESULTS["failed"] == ["the CUDA test files, graphs on"]


def test_the_prepared_gpu_check_keeps_its_last_minutes_for_the_test_files(tmp_path, monkeypatch):
    """With time kept for the test files (--test-seconds), a measuring section that would start past it is skipped
    and said to be; the test files still run."""
    import time
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    import cuda_check

    monkeypatch.setattr(cuda_check, "RESULTS", {})
    monkeypatch.delenv("CHECK_OUT", raising=False)
    monkeypatch.setattr(cuda_check, "MEASURE_UNTIL", time.perf_counter() + 600)
    cuda_check.device_facts()
    assert "device" in cuda_check.RESULTS and "skipped" not in cuda_check.RESULTS
    monkeypatch.setattr(cuda_check, "MEASURE_UNTIL", time.perf_counter())
    cuda_check.device_facts()
    (tmp_path / "test_passes.py").write_text("def test_passes():\n    assert 1 + 1 == 2\n")
    cuda_check.tests([str(tmp_path / "test_passes.py")], deadline=time.perf_counter() + 120)
    assert cuda_check.RESULTS["skipped"] == ["device"] and cuda_check.RESULTS["tests"]["outcomes"] == {"PASSED": 1}


def test_the_prepared_gpu_checks_test_files_say_what_passed_before_their_time_ran_out(tmp_path, monkeypatch):
    """A run cut short by the check's deadline (the H100's said only "timed out") still counts the tests that ended:
    one passed, one failed, the one still running not at all."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    import cuda_check

    monkeypatch.setattr(cuda_check, "RESULTS", {})
    monkeypatch.delenv("CHECK_OUT", raising=False)
    monkeypatch.setenv("TEST_WORKERS", "1")
    monkeypatch.setenv("TEST_SECONDS", "10")
    tests = ["def test_a():\n    pass", "def test_b():\n    assert False", "def test_c():\n    time.sleep(60)"]
    (tmp_path / "test_slow.py").write_text("import time\n" + "\n".join(tests) + "\n")
    cuda_check.tests([str(tmp_path / "test_slow.py")])
    assert cuda_check.RESULTS["tests"]["rc"] == "timed out"
    assert cuda_check.RESULTS["tests"]["outcomes"] == {"PASSED": 1, "FAILED": 1}


def test_the_prepared_gpu_check_times_again_a_run_that_captured_a_graph(monkeypatch):
    """A graph captured inside a timed run is start-up work in the rate (0.15-0.64 s in the head's 0.3 s runs on the
    H100): the run is timed again, and the rate is the clean run's."""
    from pathlib import Path
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    import cuda_check

    spans, captured = iter([3.0, 2.0, 1.0, 1.0]), []  # the warm-up and the first timed run capture, the next not

    def timed(llm, batch, tokens, seed, temperature=0.0):
        seconds = next(spans)
        if seconds > 1.0:
            captured.append(seconds - 1.0)
        spec = {"ttft_s": 0.0, "tpot_s": seconds / (tokens - 1), "num_output_tokens": tokens}
        spec.update(num_spec_steps=0, num_steps=tokens)
        return seconds, [SimpleNamespace(spec=spec, outputs=[SimpleNamespace(token_ids=[0] * tokens)])]

    timer = SimpleNamespace(reset=lambda: None, target_calls=1, target_time=0.0, draft_time=0.0)
    timer.draft_prefill_time = timer.propose_time = 0.0
    monkeypatch.setattr(cuda_check, "_timed", timed)
    monkeypatch.setattr(cuda_check, "captures", lambda llm: list(captured))
    llm = SimpleNamespace(engine=SimpleNamespace(timer=timer), plain_steps=[0, 0])
    tok_s, _, spec = cuda_check.generate(llm, 1, 11)
    assert tok_s == 10.0 and spec["timed_attempts"] == 2 and spec["captured_inside"] == 0


def test_the_prepared_gpu_checks_host_profile_times_decoding_steps_alone(monkeypatch, capsys, target):
    """Where the adaptive policy falls behind plain decoding, the check profiles each engine's decoding steps: its
    prompts are prefilled before the profiler starts, and what it says is a step's host time by function."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "tools"))
    import cuda_check

    from specdecode import LLM

    monkeypatch.setattr(cuda_check, "VOCAB", target.config.vocab_size)
    llm = LLM(target=target, num_speculative_tokens=0, max_model_len=256, max_num_seqs=4)
    said = cuda_check._decoding_profile("plain", llm, 4, 8)
    assert len(said) == 12 and sum(said.values()) > 0 and not llm.engine.has_unfinished()
    assert "in 7 decoding steps" in capsys.readouterr().out  # 8 tokens, the first from the prompt's forward


def _head_for(target):
    from specdecode.models.draft_head import HeadSpec, build_head, target_fingerprint

    torch.manual_seed(0)
    spec = HeadSpec(target.name, target_fingerprint(target.model), 48, target.config.vocab_size)
    return build_head(spec, None, target.model, torch.arange(target.config.vocab_size))


@pytest.mark.parametrize("fused", [False, True], ids=["eager kernels", "fused elementwise"])
def test_a_draft_heads_forwards_at_bucket_shapes_read_its_features(fused):
    """A draft head's decode and verify forwards at bucket shapes (replayed as graphs on a GPU) take each row's
    target features beside its token, as its eager forwards do: the same logits and estimated features; with the
    GPU's compiled elementwise steps (compiled for the CPU here), its input's lookup and two norms among them, too."""
    (logits, estimates), (fixed_logits, fixed_estimates) = _head_forwards(fused)
    torch.testing.assert_close(fixed_logits, logits, atol=ATOL, rtol=0)
    torch.testing.assert_close(fixed_estimates, estimates, atol=ATOL, rtol=0)


def _wrong_token_looked_up(table, tokens, weight_a, eps_a, weight_b, eps_b, features):
    return _HEAD_INPUTS(table, (tokens + 1) % table.shape[0], weight_a, eps_a, weight_b, eps_b, features)


def _halves_swapped(table, tokens, weight_a, eps_a, weight_b, eps_b, features):
    return _HEAD_INPUTS(table, tokens, weight_a, eps_a, weight_b, eps_b, features).roll(features.shape[-1], -1)


_HEAD_INPUTS = cuda_graphs._head_inputs


@pytest.mark.parametrize("broken", [_wrong_token_looked_up, _halves_swapped])
def test_a_draft_heads_compiled_input_that_reads_amiss_is_caught(broken, monkeypatch):
    """The deliberately broken variants of the head's compiled input: the next token's embedding, or the features'
    norm before the embedding's."""
    monkeypatch.setattr(cuda_graphs, "_head_inputs", broken)
    (logits, _), (fixed_logits, _) = _head_forwards(True)
    assert not torch.allclose(fixed_logits, logits, atol=ATOL, rtol=0)


def _head_forwards(fused: bool):
    """A draft head's forwards eagerly, then at bucket shapes (with the compiled elementwise steps where fused): each
    step's (logits, estimates), all steps' stacked."""
    target = tiny_model(seed=0)
    head = _head_for(target)
    hidden = target.config.hidden_size
    steps = [[10, 3], [1, 1], [3, 2], [1, 1]]  # per step, each sequence's new rows: a catch-up, decodes, verifies
    outs = []
    for fixed in (False, True):
        if fixed and fused:  # after the eager reference, which the compiled kernels' eager forms must not make
            assert cuda_graphs.fuse_elementwise(head) and head.inputs_kernel is not None
        runner = ModelRunner(head, 2, 256, fixed_shapes=fixed)
        slots, got, gen = [runner.allocate(), runner.allocate()], [], torch.Generator().manual_seed(1)
        for widths in steps:
            inputs = [torch.randint(0, 60, (n,), generator=gen).tolist() for n in widths]
            features = [torch.randn(n, hidden, generator=gen).to(head.device) for n in widths]
            got.append(runner.forward(slots, inputs, "all", hidden=True, features=features))
            for slot, n in zip(slots, widths):
                runner.commit(slot, runner.length(slot) + n)
        outs.append(got)
        assert bool(runner._fixed and runner._fixed.buckets) == fixed  # decodes and verifies took a bucket
    return [tuple(torch.cat(parts) for parts in zip(*got)) for got in outs]


def test_speculation_with_a_draft_head_at_bucket_shapes_drafts_as_eagerly(monkeypatch, tmp_path):
    """The engine with a draft head, every runner at bucket shapes: the head drafts what it drafts eagerly (the same
    tokens accepted at each position) and the output is the target's own greedy output."""
    from conftest import make_head

    prompts = [[5, 9, 14, 3, 22, 7], [40, 41, 42], list(range(10, 40))]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    target = tiny_model(seed=0)
    name = make_head(target, tmp_path / "head")

    def run(fixed: bool, k: int):
        monkeypatch.setattr(runner_module, "fixed_shapes_by_default", lambda model: fixed)
        llm = LLM(target=target, speculative_model=name if k else None, num_speculative_tokens=k,
                  max_model_len=256, speculation_policy="fixed", progress=False)  # fmt: skip
        outs = llm.generate(prompts, params)
        accepted = [(o.spec.get("num_draft_tokens"), o.spec.get("acceptance_per_position")) for o in outs]
        return [o.outputs[0].token_ids for o in outs], accepted, llm

    fixed, fixed_accepted, llm = run(True, 3)
    assert llm.engine.proposer.runner._fixed.buckets  # the head's forwards took buckets
    assert llm.engine.proposer.runner._rounds._chains  # and its rounds after the first chained
    eager, eager_accepted, _ = run(False, 3)
    assert fixed == eager == run(False, 0)[0]
    assert fixed_accepted == eager_accepted and any(any(rates) for _, rates in fixed_accepted)


# What a capture can meet: a forward that waits on the host, and (where Triton is installed) a kernel the device
# cannot hold, which Triton raises at its first launch, in the warm-up before the graph
CAPTURE_FAILURES = [RuntimeError("operation not permitted when stream is capturing")] + [
    error(151872, 101376, "shared memory") for error in cuda_graphs.UNFIT_KERNEL[:1]
]


@pytest.mark.parametrize("failure", CAPTURE_FAILURES, ids=lambda e: type(e).__name__)
def test_forwards_and_chains_whose_capture_fails_run_eagerly(captured, monkeypatch, tmp_path, failure):
    """Every capture failing (the target's buckets, the head's and its chained rounds'): the engine serves the same
    greedy output eagerly, tries each bucket once, and raises nothing."""
    from conftest import make_head

    prompts = [[5, 9, 14, 3, 22, 7], list(range(10, 40))]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    target = tiny_model(seed=0)
    name = make_head(target, tmp_path / "head")
    plain = LLM(target=target, max_model_len=256, progress=False).generate(prompts, params)
    plain = [o.outputs[0].token_ids for o in plain]
    attempts = []

    def failing(self, batch, run):
        attempts.append((id(self), batch.bucket))
        raise failure

    monkeypatch.setattr(runner_module, "fixed_shapes_by_default", lambda model: True)
    monkeypatch.setattr(cuda_graphs.BucketedForward, "capture_graph", failing)
    llm = LLM(target=target, speculative_model=name, num_speculative_tokens=3, max_model_len=256,
              speculation_policy="fixed", progress=False)  # fmt: skip
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    runners = (llm.engine.runner, llm.engine.proposer.runner)
    assert attempts and all(not r._fixed._entries and r._fixed._refused for r in runners)
    assert not llm.engine.proposer.runner._rounds._chains and llm.engine.proposer.runner._rounds._refused
    tried = set(attempts)
    attempts.clear()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == plain
    assert not tried & set(attempts)  # a bucket that failed is not captured again (a call it refused may try others)


@pytest.mark.parametrize("drafter", ["head", "draft model"])
def test_sampled_speculation_with_chained_rounds_drafts_as_rounds_one_by_one(monkeypatch, tmp_path, drafter):
    """The engine, every runner at bucket shapes, seeded sampled requests of several settings beside a greedy one:
    the drafter's rounds chain (sampled rows drawing on the device at uniforms drawn beforehand from each stream), and
    each request gets the output and acceptance it gets with eager forwards, rounds one by one; a batch with a
    penalised request drafts one by one."""
    from conftest import make_head

    prompts = [[5, 9, 14, 3, 22, 7], [40, 41, 42], list(range(10, 40))]
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=8, top_p=0.9, seed=2, max_tokens=24, ignore_eos=True),
    ]
    target = tiny_model(seed=0)
    # a draft model chains its rounds where no confidence stop would end them early
    kind = {"speculative_model": make_head(target, tmp_path / "head")} if drafter == "head" else {"draft_confidence": 0}
    draft = None if drafter == "head" else tiny_model(seed=0, layers=1)

    def run(fixed: bool, requests):
        monkeypatch.setattr(runner_module, "fixed_shapes_by_default", lambda model: fixed)
        llm = LLM(target=target, draft=draft, num_speculative_tokens=3, max_model_len=256, speculation_policy="fixed",
                  progress=False, **kind)  # fmt: skip
        outs = llm.generate(prompts, requests)
        accepted = [o.spec.get("acceptance_per_position") for o in outs]
        rounds = llm.engine.proposer.runner._rounds
        return [o.outputs[0].token_ids for o in outs], accepted, {key[2] for key in rounds._chains} if rounds else None

    (chained, chained_accepted, kinds), (eager, eager_accepted, _) = run(True, params), run(False, params)
    assert frozenset({"top_k", "top_p"}) in kinds  # sampled rounds chained
    assert chained == eager and chained_accepted == eager_accepted
    assert any(any(rates) for rates in chained_accepted) and len({tuple(t) for t in chained}) == 3
    penalised = [params[0], params[1], SamplingParams(temperature=0.9, seed=3, presence_penalty=0.4, max_tokens=24)]
    assert run(True, penalised)[0] == run(False, penalised)[0]


def _drafting_runner(model, fixed: bool, features_of, prompts):
    """A runner of the drafter with each prompt read and one drafting round run: (runner, slots, that round's logits,
    its estimated features or None)."""
    runner = ModelRunner(model, len(prompts), 256, fixed_shapes=fixed)
    slots = [runner.allocate() for _ in prompts]
    runner.forward(slots, prompts, "last", features=features_of(prompts))
    for slot, prompt in zip(slots, prompts):
        runner.commit(slot, len(prompt))
    last = [[p[-1]] for p in prompts]
    out = runner.forward(slots, last, "last", hidden=features_of(last) is not None, features=features_of(last))
    for slot, prompt in zip(slots, prompts):
        runner.commit(slot, len(prompt) + 1)
    return (runner, slots, *out) if isinstance(out, tuple) else (runner, slots, out, None)


def _one_by_one(runner, slots, logits, estimates, rounds):
    """Greedy drafting round by round from the host, as a CPU drafts: per slot, (draft, probability) pairs."""

    def argmax(step_logits, row, done):
        token = int(step_logits.argmax())
        return token, float(torch.softmax(step_logits.float(), -1)[token])

    return _rounds_one_by_one(runner, slots, logits, estimates, rounds, argmax)


def _rounds_one_by_one(runner, slots, logits, estimates, rounds, pick):
    """Drafting round by round from the host: per slot, what pick(its logits, its row, drafts so far) gives for each
    round (a tuple, the draft first), each round reading the draft before it."""
    drafts = []
    for row, (slot, r) in enumerate(zip(slots, rounds)):
        step_logits, feature = logits[row], None if estimates is None else estimates[row : row + 1]
        mine = []
        while True:
            mine.append(pick(step_logits, row, len(mine)))
            if len(mine) == r + 1:
                break
            features = None if feature is None else [feature]
            out = runner.forward([slot], [[mine[-1][0]]], "last", hidden=features is not None, features=features)
            step_logits, feature = (out[0][0], out[1]) if isinstance(out, tuple) else (out[0], None)
            runner.commit(slot, runner.length(slot) + 1)
        drafts.append(mine)
    return drafts


def _chained_and_one_by_one(drafter: str, rounds: list[int]):
    """A drafter's chained drafts and those of rounds one by one, from the same first round; with the chained runner
    and its slots' keys before the chain."""
    target = tiny_model(seed=0)
    model = _head_for(target) if drafter == "head" else tiny_model(seed=2, layers=1).model
    gen = torch.Generator().manual_seed(3)
    width = target.config.hidden_size

    def features_of(inputs):
        if drafter != "head":
            return None
        return [torch.randn(len(t), width, generator=torch.Generator().manual_seed(len(t))).to(DEVICE) for t in inputs]

    prompts = [torch.randint(1, 60, (n,), generator=gen).tolist() for n in (12, 5, 30)]
    runner, slots, logits, estimates = _drafting_runner(model, True, features_of, prompts)
    before = [runner._cache.keys(0, s, runner.blocks_held(s) * runner.block_size) for s in slots]
    starts = [runner.length(s) for s in slots]
    out = runner.chained_rounds(slots, logits, estimates, rounds)
    assert out is not None and out[2] is None and runner._rounds._chains  # the rounds chained, greedy
    tokens, probs = (t.double().tolist() for t in out[:2])
    chained = [[(int(t), p) for t, p in zip(ts[: r + 1], ps[: r + 1])] for ts, ps, r in zip(tokens, probs, rounds)]
    reference = _drafting_runner(model, False, features_of, prompts)
    return chained, _one_by_one(*reference, rounds), (runner, slots, starts, before, reference[0])


def _same_drafts(chained, expected) -> bool:
    if [[t for t, _ in d] for d in chained] != [[t for t, _ in d] for d in expected]:
        return False
    probs = [torch.tensor([p for _, p in d]) for d in chained], [torch.tensor([p for _, p in d]) for d in expected]
    return all(torch.allclose(a, b, atol=ATOL, rtol=0) for a, b in zip(*probs))


@pytest.mark.parametrize("drafter", ["head", "draft model"])
def test_chained_greedy_rounds_draft_what_rounds_one_by_one_do(drafter):
    """A drafter's rounds after the first chained on the device (one replay on a GPU): each sequence's drafts and their
    probabilities are those of rounds run one by one; its keys are those rounds' keys, and a sequence that drafts fewer
    rounds than the longest leaves every row past its own as it was (its extra rounds write the scratch block)."""
    rounds = [3, 1, 0]
    chained, expected, (runner, slots, starts, before, reference) = _chained_and_one_by_one(drafter, rounds)
    assert [len(d) for d in chained] == [4, 2, 1] and _same_drafts(chained, expected)
    assert _same_keys(runner, slots, starts, rounds, reference)
    for slot, start, r, old in zip(slots, starts, rounds, before):
        rows = runner.blocks_held(slot) * runner.block_size
        assert torch.equal(runner._cache.keys(0, slot, rows)[:, start + r :], old[:, start + r : rows])


# Sequences of a sampled chain: sampled ones of several settings (truncations on some rows only) beside a greedy one
SAMPLED = [
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=0),
    SamplingParams(temperature=1.3, top_k=5, top_p=0.9, min_p=0.02),
]


def _drafter(kind: str):
    """A drafter's model ("head", "draft model" or "restricted draft model": a draft vocabulary of 20 ids) and a
    function giving the target features it reads beside each input (None: it reads none)."""
    from specdecode.proposers.vocabulary import restrict_draft_vocab

    target = tiny_model(seed=0)
    width = target.config.hidden_size
    if kind == "head":
        return _head_for(target), lambda inputs: [
            torch.randn(len(t), width, generator=torch.Generator().manual_seed(len(t))).to(DEVICE) for t in inputs
        ]
    draft = tiny_model(seed=2, layers=1)
    if kind.startswith("restricted"):
        restrict_draft_vocab(draft, 20)
    return draft.model, lambda inputs: None


def _sampled_one_by_one(runner, slots, logits, estimates, rounds, uniforms):
    """SAMPLED's drafting round by round from the host, as a CPU drafts: per slot, (draft, probability, q) triples,
    a sampled row's q over the target's vocabulary (-inf outside a restricted draft vocabulary's), its draft drawn at
    its round's uniform."""
    from specdecode.sampling import logits_to_probs, sample_at

    vocab_ids, vocab = runner.vocab_ids, runner.cfg.vocab_size

    def by_settings(step_logits, row, done):
        full = step_logits.float()
        if vocab_ids is not None:
            full = torch.full((vocab,), float("-inf"), device=full.device).index_copy_(0, vocab_ids, full)
        if SAMPLED[row].greedy:
            return int(full.argmax()), float(torch.softmax(step_logits.float(), -1).max()), None
        q = logits_to_probs(full[None], SAMPLED[row])[0]
        token = int(sample_at(q[None], uniforms[row, done][None])[0])
        return token, float(q[token]), q

    return _rounds_one_by_one(runner, slots, logits, estimates, rounds, by_settings)


def _sampled_chained_and_one_by_one(drafter: str, rounds: list[int], broken=None):
    """SAMPLED's chained drafts and those of rounds one by one from the same first round and uniforms: per slot,
    (draft, probability, q) triples each. broken(params, uniforms) -> what the chain is given instead."""
    model, features_of = _drafter(drafter)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 60, (n,), generator=gen).tolist() for n in (12, 5, 30)]
    uniforms = torch.rand(len(prompts), max(rounds) + 1, generator=gen, dtype=torch.float64).to(DEVICE)
    runner, slots, logits, estimates = _drafting_runner(model, True, features_of, prompts)
    sampling = (SAMPLED, uniforms) if broken is None else broken(SAMPLED, uniforms)
    out = runner.chained_rounds(slots, logits, estimates, rounds, sampling)
    assert out is not None and runner._rounds._chains  # the rounds chained
    (tokens, probs), q = (t.double().tolist() for t in out[:2]), out[2]
    chained = [
        [(int(t), p, q[row, j] if not params.greedy else None) for j, (t, p) in enumerate(zip(ts[: r + 1], ps))]
        for row, (ts, ps, r, params) in enumerate(zip(tokens, probs, rounds, SAMPLED))
    ]
    reference = _drafting_runner(model, False, features_of, prompts)
    return chained, _sampled_one_by_one(*reference, rounds, uniforms)


def _same_sampled_drafts(chained, expected) -> bool:
    def pairs(drafts):
        return [[(t, p) for t, p, _ in d] for d in drafts]

    def close(a, b):
        return (a is None and b is None) or torch.allclose(a, b, atol=ATOL, rtol=0)

    qs = [(qa, qb) for da, db in zip(chained, expected) for (_, _, qa), (_, _, qb) in zip(da, db)]
    return _same_drafts(pairs(chained), pairs(expected)) and all(close(qa, qb) for qa, qb in qs)


@pytest.mark.parametrize("drafter", ["head", "draft model", "restricted draft model"])
def test_chained_sampled_rounds_draft_what_rounds_one_by_one_do(drafter):
    """Sampled rows of several settings beside a greedy one, their rounds chained (one replay on a GPU): each row's
    drafts, their probabilities and a sampled row's q over the target's vocabulary are those of rounds run one by one
    from the host at the same uniforms (the greedy row's, its argmax)."""
    rounds = [3, 2, 3]
    chained, expected = _sampled_chained_and_one_by_one(drafter, rounds)
    assert [len(d) for d in chained] == [4, 3, 4] and _same_sampled_drafts(chained, expected)
    sampled_tokens = [t for d, p in zip(chained, SAMPLED) if not p.greedy for t, _, _ in d]
    assert len(set(sampled_tokens)) > 2  # draws, not one token over and over


def test_replayed_sampled_chains_draft_what_rounds_one_by_one_do(captured):
    chained, expected = _sampled_chained_and_one_by_one("head", [3, 2, 3])
    assert _same_sampled_drafts(chained, expected)


def test_sampled_chains_hold_no_more_than_the_memory_plan_reserves():
    """Sampled chains of every bucket (1, 2 and 4 sequences) and number of rounds (1 to 3, k_max = 4) hold the first
    round's logits and q within what the memory plan reserves for them on a GPU (memory.chained_rounds_reserve)."""
    from specdecode.engine.memory import chained_rounds_reserve

    model, features_of = _drafter("draft model")
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    runner, slots, logits, _ = _drafting_runner(model, True, features_of, prompts)
    uniforms = torch.rand(len(prompts), 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for n in (1, 2, 3):
        for rounds in (1, 2, 3):
            sampling = (SAMPLED[:n], uniforms[:n, : rounds + 1].to(DEVICE))
            assert runner.chained_rounds(slots[:n], logits[:n], None, [rounds] * n, sampling) is not None
    buffers = [*runner._rounds._q.values(), *runner._rounds._first.values()]
    held = sum(t.numel() * t.element_size() for t in buffers)
    assert len(buffers) == 9 + 3 and held <= chained_rounds_reserve(model.cfg, len(prompts), 4)


class _OpsOutside(TorchDispatchMode):
    """The ATen operations dispatched outside a chain's rounds (DraftChain._run: in its graph on a GPU), by name,
    views left out (they launch nothing)."""

    VIEWS = {"alias", "view", "slice", "select", "unsqueeze", "expand", "lift_fresh", "detach", "_unsafe_view"}

    def __init__(self):
        super().__init__()
        self.names, self.inside = set(), False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.inside and name not in self.VIEWS:
            self.names.add(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["head", "restricted draft model"])
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_chained_rounds_pick_the_first_draft_inside_the_chain(captured, monkeypatch, kind, sampled):
    """Outside its graph, drafting by chained rounds only copies inputs in: the first round's pick (argmax, softmax,
    a draw) runs within the chain's replay, where its kernels cost no launch each."""
    from specdecode.executor.draft_chain import DraftChain

    model, features_of = _drafter(kind)
    prompts = [[5, 6, 7, 8], [9, 10]]
    runner, slots, logits, estimates = _drafting_runner(model, True, features_of, prompts)
    sampling = None
    if sampled:
        uniforms = torch.rand(len(prompts), 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        sampling = (SAMPLED[:2], uniforms.to(DEVICE))
    ops, run = _OpsOutside(), DraftChain._run

    def marked(self, chain):
        ops.inside = True
        run(self, chain)
        ops.inside = False

    monkeypatch.setattr(DraftChain, "_run", marked)
    runner.chained_rounds(slots, logits, estimates, [3, 2], sampling)  # captured: the chain's first run
    with ops:
        out = runner.chained_rounds(slots, logits, estimates, [3, 2], sampling)  # replayed
    assert out is not None and out[0].shape == (2, 4)
    copies = {"copy_", "_to_copy", "zero_", "fill_"}
    host_memory = {"empty", "empty_strided", "_pin_memory", "pin_memory", "is_pinned"}  # launch nothing (a GPU's)
    assert ops.names <= copies | host_memory, ops.names


def test_a_chains_greedy_drafts_are_one_compiled_kernel_that_picks_as_the_eager_form(captured):
    """Where chains are captured, their greedy pick is compiled (eight kernels a round eager): the same argmax, the
    first of tied logits included, and its probability; a compiled form that picks otherwise is refused at start-up."""
    from specdecode.executor import draft_chain

    model, features_of = _drafter("restricted draft model")
    runner, slots, logits, _ = _drafting_runner(model, True, features_of, [[5, 6, 7]])
    assert runner._rounds._greedy is None  # compiled with the first chain, not for every runner (a target's)
    runner.chained_rounds(slots, logits, None, [2])
    fused = draft_chain.fused_greedy_drafts(DEVICE)
    assert runner._rounds._greedy is fused and fused is not draft_chain.greedy_drafts
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    logits[2, [7, 9, 250]] = 50.0  # a tie: the first column wins, as argmax has it
    ids = torch.randperm(1000, generator=torch.Generator().manual_seed(2))[:300].to(DEVICE)
    with torch.inference_mode():
        for vocab_ids in (None, ids):
            (tokens, probs), (want, want_probs) = fused(logits, vocab_ids), draft_chain.greedy_drafts(logits, vocab_ids)
            assert torch.equal(tokens, want) and int(want[2]) == (7 if vocab_ids is None else int(ids[7]))
            torch.testing.assert_close(probs, want_probs)


def test_a_compiled_greedy_pick_that_disagrees_is_refused(monkeypatch):
    from specdecode.executor import draft_chain

    def off_by_one(fn, **options):
        return lambda logits, vocab_ids: (fn(logits, vocab_ids)[0] + 1, fn(logits, vocab_ids)[1])

    monkeypatch.setattr(torch, "compile", off_by_one)
    assert draft_chain.fused_greedy_drafts.__wrapped__(DEVICE) is draft_chain.greedy_drafts


BROKEN_SAMPLED_CHAIN = {
    # each round drawing at the next round's uniform
    "uniforms a round late": lambda params, uniforms: (params, uniforms.roll(-1, 1)),
    # every row by the first row's settings
    "one setting for all": lambda params, uniforms: ([params[0]] * len(params), uniforms),
    # each row drawing at the next row's uniforms
    "streams mixed up": lambda params, uniforms: (params, uniforms.roll(1, 0)),
}


@pytest.mark.parametrize("broken", list(BROKEN_SAMPLED_CHAIN))
def test_chained_sampled_rounds_given_the_wrong_draws_are_caught(broken):
    chained, expected = _sampled_chained_and_one_by_one("draft model", [3, 2, 3], BROKEN_SAMPLED_CHAIN[broken])
    assert not _same_sampled_drafts(chained, expected)


def _same_keys(runner, slots, starts, rounds, reference) -> bool:
    """Whether each sequence's keys up to its last round are those its rounds one by one wrote."""
    for slot, start, r in zip(slots, starts, rounds):
        now, want = runner._cache.keys(0, slot, start + r), reference._cache.keys(0, slot, start + r)
        if not torch.allclose(now, want, atol=ATOL, rtol=0):
            return False
    return True


def _features_not_fed(batch, drafts, positions, slots, estimates, rope):
    return batch.with_rows(drafts[:, None], positions[:, None], slots[:, None], None, rope)


def _positions_not_advanced(batch, drafts, positions, slots, estimates, rope):
    features = None if estimates is None else estimates.view(batch.features.shape)
    return batch.with_rows(drafts[:, None], batch.positions, slots[:, None], features)


def _rope_of_another_sequence(batch, drafts, positions, slots, estimates, rope):
    features = None if estimates is None else estimates.view(batch.features.shape)
    rope = {kind: tuple(t.roll(1, 0) for t in pair) for kind, pair in rope.items()}
    return batch.with_rows(drafts[:, None], positions[:, None], slots[:, None], features, rope)


@pytest.mark.parametrize("drafter", ["head", "draft model"])
def test_replayed_chains_draft_what_rounds_one_by_one_do(captured, drafter):
    chained, expected, (runner, *_) = _chained_and_one_by_one(drafter, [3, 1, 0])
    assert all(chain.graph is not None for chain in runner._rounds._chains.values())
    assert _same_drafts(chained, expected)


@pytest.mark.parametrize("broken", [_features_not_fed, _positions_not_advanced, _rope_of_another_sequence])
def test_chained_rounds_that_read_the_wrong_inputs_are_caught(monkeypatch, broken):
    """The deliberately broken variants: a head's rounds that read the first round's features again, rounds that
    all read and write one position, or rows rotated at another sequence's positions."""
    from specdecode.executor.draft_chain import DraftChain

    monkeypatch.setattr(DraftChain, "_next_round", staticmethod(broken))
    rounds = [3, 3, 3]
    chained, expected, (runner, slots, starts, _, reference) = _chained_and_one_by_one("head", rounds)
    # a GPU's tolerance can hide a head's small drafts' change; the keys of rows never written cannot
    assert not (_same_drafts(chained, expected) and _same_keys(runner, slots, starts, rounds, reference))


def test_chained_rounds_that_write_past_a_sequences_own_rows_are_caught(monkeypatch):
    """The deliberately broken variant: every sequence runs the longest's rounds into its own blocks."""
    from specdecode.executor.draft_chain import DraftChain

    run = DraftChain.run
    monkeypatch.setattr(
        DraftChain, "run", lambda self, c, s, st, f, ft, r, *rest: run(self, c, s, st, f, ft, [max(r)] * len(r), *rest)
    )
    model = tiny_model(seed=2, layers=1).model
    prompts = [[5, 6, 7, 8], [9, 10]]
    runner, slots, logits, _ = _drafting_runner(model, True, lambda inputs: None, prompts)
    starts = [runner.length(s) for s in slots]
    before = runner._cache.keys(0, slots[1], runner.block_size)
    runner.chained_rounds(slots, logits, None, [3, 0])
    assert not torch.equal(runner._cache.keys(0, slots[1], runner.block_size)[:, starts[1] :], before[:, starts[1] :])
