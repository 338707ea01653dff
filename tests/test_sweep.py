"""bench sweep (config grid, in-process runs, speedups, report) and the advisor (specdecode plan), on tiny models."""

import json

import pytest
from conftest import tiny_model

from specdecode import SpecDecodeError
from specdecode.bench.advisor import AdvisorOptions, calibrate, ceiling, expected_tokens, predict
from specdecode.bench.report import write_report
from specdecode.bench.sweep import InProcessRunner, add_speedups, measure_grid, parse_config, read_config

CONFIG = """
[sweep]
max_tokens = 12
num_prompts = 2
[[grid]]
name = "k"
proposer = ["none", "draft", "ngram"]
k = [2, 3]
[[grid]]
name = "load"
proposer = ["none", "draft"]
policy = ["fixed", "adaptive"]
concurrency = [1, 2]
"""


def test_grid_blocks_are_crossed_and_plain_cells_collapse(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text(CONFIG)
    config = parse_config(read_config(path))
    k_block = [c for c in config.cells if c.group == "k"]
    assert [c.label for c in k_block] == ["plain", "draft k=2", "draft k=3", "ngram k=2", "ngram k=3"]
    load = [c for c in config.cells if c.group == "load"]
    assert len(load) == 2 + 2 * 2  # plain once per concurrency, draft for both policies
    # each concurrency's cells run together, after their plain baseline
    assert [(c.label, c.concurrency) for c in load] == [
        ("plain", 1),
        ("draft k=4", 1),
        ("draft k=4 adaptive", 1),
        ("plain", 2),
        ("draft k=4", 2),
        ("draft k=4 adaptive", 2),
    ]
    assert all(c.max_tokens == 12 and c.num_prompts == 2 for c in config.cells)  # [sweep] defaults reach cells


def test_any_registered_kind_is_a_cell_and_head_takes_its_path(tmp_path):
    path = tmp_path / "sweep.toml"
    path.write_text("[[grid]]\nproposer = ['suffix', 'head:heads/tiny']\nk = 2\n")
    assert [c.label for c in parse_config(read_config(path)).cells] == ["suffix k=2", "head:heads/tiny k=2"]


def test_yaml_config_gives_the_same_cells(tmp_path):
    yaml = pytest.importorskip("yaml")
    import tomllib

    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(tomllib.loads(CONFIG), sort_keys=False))
    toml = tmp_path / "sweep.toml"
    toml.write_text(CONFIG)
    assert parse_config(read_config(path)).cells == parse_config(read_config(toml)).cells


@pytest.mark.parametrize(
    "text, message",
    [
        ("[[grid]]\nproposr = 'draft'", "unknown key(s) ['proposr']"),
        ("[[grid]]\nproposer = 'medusa'", "proposer 'medusa' is not one of"),
        ("[[grid]]\nproposer = 'medusa:heads.bin'", "proposer 'medusa:heads.bin' is not one of"),
        ("[[grid]]\nproposer = 'draft'\nk = 0", "k must be >= 1"),
        ("[sweep]\nmode = 'cloud'\n[[grid]]\nk = 2", "mode must be"),
        ("[sweep]\nmax_tokens = 8", "no [[grid]] blocks"),
        ("[grid\n", "not valid TOML"),
    ],
)
def test_bad_configs_say_what_to_change(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SpecDecodeError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        parse_config(read_config(path))


def test_speedups_come_from_plain_on_the_same_dataset_and_concurrency():
    def row(group, proposer, c, tok_s, dataset="humaneval", n=4):
        return {
            "group": group,
            "proposer": proposer,
            "concurrency": c,
            "dataset": dataset,
            "max_tokens": 8,
            "num_requests": n,
            "output_throughput": tok_s,
            "tpot_s": {"mean": 1 / tok_s},
        }

    rows = [
        row("a", "none", 1, 10.0),
        row("a", "draft", 1, 15.0),
        row("a", "none", 2, 20.0),
        row("a", "draft", 2, 16.0),
        row("b", "draft", 1, 30.0),
        row("c", "none", 1, 5.0, "sonnet:256"),
        row("c", "ngram", 1, 6.0, "sonnet:256"),
    ]
    add_speedups(rows)
    assert [r.get("speedup") for r in rows] == pytest.approx([1.0, 1.5, 1.0, 0.8, 3.0, 1.0, 1.2])
    assert rows[1]["tpot_reduction"] == pytest.approx(1.5)


def test_proposers_are_ranked_by_their_best_fixed_k_per_dataset():
    from specdecode.bench.sweep_report import proposer_findings

    def row(proposer, k, speedup, dataset="humaneval", forced=False):
        return {
            "proposer": proposer,
            "k": k,
            "speedup": speedup,
            "dataset": dataset,
            "concurrency": 1,
            "policy": "fixed",
            "forced_accept": forced,
            "acceptance_rate": 0.5,
        }

    rows = [
        row("draft", 2, 1.4),
        row("draft", 4, 1.6),
        row("head:h", 2, 1.2),
        row("ngram", 2, 1.1),
        row("draft", 4, 2.5, forced=True),
        row("ngram", 4, 1.9, "sonnet:256"),
        row("suffix", 4, 2.1, "sonnet:512"),
    ]
    assert proposer_findings(rows) == [
        "On humaneval, by each proposer's best fixed k: draft 1.60× (α 0.500, k=4), head:h 1.20× (α 0.500, k=2), "
        "ngram 1.10× (α 0.500, k=2).",
        "On sonnets, by each proposer's best fixed k: suffix 2.10× (α 0.500, k=4), ngram 1.90× (α 0.500, k=4).",
    ]


@pytest.fixture(scope="module")
def models():
    return tiny_model(0), tiny_model(1)


def test_in_process_sweep_writes_results_and_report(tmp_path, models):
    target, draft = models
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt": p}) for p in ["the cat sat on the mat", "abcabcabcabc", "hello hello hello"])
    )
    config = parse_config(
        {
            "sweep": {
                "max_tokens": 10,
                "num_prompts": 3,
                "dataset": f"jsonl:{prompts}",
                "out": str(tmp_path / "out"),
                "max_model_len": 128,
            },
            "plan": {
                "k_max": 3,
                "batch_sizes": [1, 2],
                "num_prompts": 1,
                "max_tokens": 8,
                "context": 16,
                "repeats": 1,
                "dataset": f"jsonl:{prompts}",
            },
            "grid": [
                {"name": "k", "proposer": ["none", "draft", "ngram"], "k": [2, 3]},
                {"name": "bound", "proposer": "draft", "k": 3, "forced_accept": True},
                {
                    "name": "load",
                    "proposer": ["none", "draft"],
                    "policy": ["fixed", "adaptive"],
                    "k": 2,
                    "concurrency": [1, 2],
                },
            ],
        }
    )
    report = measure_grid(config, runner=InProcessRunner(config, config.cells, target, draft))
    rows = report["results"]
    assert len(rows) == len(config.cells) == 5 + 1 + 6
    for r in rows:  # EOS ignored: every request ran to max_tokens, none failed
        assert r["num_failed"] == 0 and r["output_tokens"] == r["num_requests"] * 10
        assert r["speedup"] > 0
    bound = next(r for r in rows if r["forced_accept"])
    assert bound["acceptance_rate"] == 1.0 and bound["mean_accepted_length"] == 4.0
    real = next(r for r in rows if r["label"] == "draft k=3" and r["group"] == "k")
    assert real["acceptance_rate"] < 1.0  # two different random models do disagree
    assert len(list((tmp_path / "out" / "runs").glob("*.json"))) == len(rows)
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert set(plan["predicted_speedup"]) == {"1", "2"}

    path = write_report(tmp_path / "out")
    text = path.read_text()
    for png in ("sweep_k.png", "sweep_throughput_vs_concurrency.png", "sweep_predicted_vs_measured.png"):
        assert (tmp_path / "out" / png).read_bytes()[:4] == b"\x89PNG"
        assert f"]({png})" in text
    assert "Best k at concurrency 1" in text and "the plan recommended k =" in text
    assert "ceiling, every draft accepted and drafting free: b=1 " in text
    assert "Upper bound, every draft token accepted, draft k=3" in text
    assert "| load | jsonl:" in text


def test_plan_with_a_self_draft_expects_every_token(models):
    """A draft identical to the target is always accepted, so a step with k drafts emits exactly k + 1."""
    target, _ = models
    options = AdvisorOptions(
        k_max=3, batch_sizes=[1, 2], num_prompts=1, max_tokens=8, context=16, repeats=1, dataset="sonnet:200"
    )
    plan = calibrate(target, target, options)
    assert plan["prefix_acceptance"] == [1.0, 1.0, 1.0]
    assert plan["expected_tokens"] == {1: 2.0, 2: 3.0, 3: 4.0}
    assert plan["predicted_speedup"][2][3] == pytest.approx(
        4.0 * plan["target_seconds"][2][1] / (plan["target_seconds"][2][4] + 3 * plan["draft_seconds"][2])
    )
    best, tokens = plan["ceiling"][2]
    seconds = plan["target_seconds"][2]
    assert best >= 1.0 and best == pytest.approx(tokens * seconds[1] / seconds[tokens])


def test_expected_tokens_use_prefix_acceptance_not_independence():
    prefix = [0.8, 0.7, 0.65]  # bursty: once two are accepted, the third usually is too
    assert expected_tokens(prefix, 3) == pytest.approx(1 + 0.8 + 0.7 + 0.65)
    target = {1: {1: 1.0, 4: 1.2}}
    assert predict(prefix, target, {1: 0.1}, 3, 1) == pytest.approx(3.15 / 1.5)


def test_ceiling_is_the_best_verify_length_with_every_draft_accepted():
    """Memory-bound steps (a longer verify costs little more) leave room for t tokens a step; compute-bound
    ones (a verified token costs a decoded one) leave none, whatever the drafter."""
    seconds = {
        1: {1: 1.0, 2: 1.2, 3: 1.9, 4: 2.5},  # 2 tokens for 1.2 beat 3 for 1.9 and 4 for 2.5
        8: {1: 4.0, 2: 8.0, 3: 12.0, 4: 16.4},
    }  # every row costs a decoded token's time
    best = ceiling(seconds)
    assert best[1] == (pytest.approx(2 / 1.2), 2)
    assert best[8] == (pytest.approx(1.0), 1)


def test_transformers_baseline_runs_the_same_weights():
    """The baseline's transformers model, built from the tensors specdecode loads, computes the same
    logits as specdecode's runtime: the two engines differ only in how they decode."""
    import torch
    from conftest import random_hf_weights, tiny_config

    from specdecode.bench.hf_baseline import hf_model_from
    from specdecode.executor.runner import ModelRunner
    from specdecode.models.runtime import build_model

    cfg = tiny_config("qwen2")
    weights = random_hf_weights(cfg, seed=3)
    ours = build_model(cfg, weights, torch.float32, "cpu")
    theirs = hf_model_from(cfg, weights, torch.float32)
    ids = [5, 9, 2, 33, 17, 8]
    runner = ModelRunner(ours, 1, 32)
    mine = runner.forward([runner.allocate()], [ids], logits="all")
    with torch.inference_mode():
        reference = theirs(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(mine.float(), reference.float(), atol=1e-4, rtol=1e-4)


def test_two_draft_models_are_compared_in_one_sweep(tmp_path, models):
    target, other = models
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "the cat sat on the mat"}) + "\n")
    config = parse_config(
        {
            "sweep": {
                "max_tokens": 8,
                "num_prompts": 2,
                "dataset": f"jsonl:{prompts}",
                "out": str(tmp_path / "out"),
                "max_model_len": 128,
                "draft": "random",
            },
            "grid": [{"proposer": ["none", "draft"], "draft": ["", "self"], "k": 3}],
        }
    )
    assert [c.label for c in config.cells] == ["plain", "draft k=3", "draft self k=3"]
    runner = InProcessRunner(config, config.cells, target, drafts={"random": other, "self": target})
    rows = measure_grid(config, runner=runner)["results"]
    assert rows[2]["acceptance_rate"] == 1.0 > rows[1]["acceptance_rate"]  # a self-draft is always right


def test_server_mode_passes_valid_serve_flags():
    from specdecode.bench.sweep import ServerRunner
    from specdecode.cli import build_parser

    config = parse_config(
        {
            "sweep": {"mode": "server"},
            "grid": [
                {
                    "proposer": ["none", "draft", "ngram"],
                    "k": 3,
                    "concurrency": [1, 4],
                    "policy": "disable_by_batch_size",
                    "disable_by_batch_size": 2,
                    "forced_accept": True,
                }
            ],
        }
    )
    runner = ServerRunner(config, config.cells)
    parsed = {c.label: build_parser().parse_args(["serve"] + runner.serve_args(c)) for c in config.cells}
    assert parsed["plain"].num_speculative_tokens == 0 and parsed["plain"].max_num_seqs == 4
    draft = parsed["draft k=3 off above 2 forced-accept"]
    assert (
        draft.speculative_model,
        draft.num_speculative_tokens,
        draft.speculation_policy,
        draft.speculative_disable_by_batch_size,
        draft.forced_accept,
    ) == ("qwen2.5-coder-0.5b", 3, "disable_by_batch_size", 2, True)
    assert parsed["ngram k=3 off above 2 forced-accept"].speculative_model == "ngram"


def test_the_study_drafts_from_no_earlier_output_of_its_repeated_prompts(target):
    """Its prompts repeat to fill a cell: a suffix cache would copy the earlier output of the same prompt, so cells
    keep none, in process and through a server."""
    from specdecode.bench.sweep import ServerRunner

    config = parse_config({"sweep": {"max_tokens": 4, "max_model_len": 64}, "grid": [{"proposer": "suffix", "k": 2}]})
    cell = config.cells[0]
    llm = InProcessRunner(config, config.cells, target).build(cell, 1)
    assert llm.engine.lookup.cache.scope == "none"
    argv = ServerRunner(config, config.cells).serve_args(cell)
    assert argv[argv.index("--suffix-cache-scope") + 1] == "none"
