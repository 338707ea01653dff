"""tools/tree_acceptance.py's replay of greedy decoding with a tree of drafts: the trees it makes are prefix-closed and
hold the most frequent rank paths, a tree takes the longest prefix of a step's true rank path it holds, a chain stops
right after an unsure draft, and the replay starts each step after the tokens the last one took."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from tree_acceptance import RANKS, chain, in_tree, replay, tree_of  # noqa: E402


def test_a_tree_holds_the_most_frequent_paths_and_each_one_s_parent():
    counts = Counter({(0,): 10, (1,): 6, (0, 0): 7, (0, 1): 2, (1, 0): 5, (2,): 1, (5, 0): 9})
    assert tree_of(counts, 3) == {(0,), (0, 0), (1,)}
    assert tree_of(counts, 4) == {(0,), (0, 0), (1,), (1, 0)}
    assert (5, 0) not in tree_of(counts, 7)  # its parent (5,) was never on the true path


def test_a_tree_takes_the_longest_prefix_of_the_true_path_it_holds():
    accept = in_tree({(0,), (1,), (0, 0), (1, 0), (0, 0, 2)})
    assert accept([0, 0, 2, 0], None) == 3
    assert accept([1, 0, 0], None) == 2
    assert accept([1, 1, 0], None) == 1
    assert accept([2, 0, 0], None) == 0


def test_a_chain_stops_right_after_its_first_unsure_draft():
    assert chain(4, 0.8)([0, 0, 0, 0, 0], [0.9, 0.5, 0.9, 0.9, 0.9]) == 2  # the unsure second draft is still drafted
    assert chain(4, 0.0)([0, 0, 0, 0, 0], [0.9, 0.5, 0.9, 0.9, 0.9]) == 4
    assert chain(4, 0.0)([0, 1, 0, 0], [1.0] * 4) == 1


def test_the_replay_starts_each_step_after_the_tokens_the_last_one_took():
    """13 tokens (12 rows), a prompt of 2: the first step starts at row 1; a step that takes t drafts emits t + 1;
    the last step starts where the next token is still in the sequence."""
    ranks = torch.full((12, 3), RANKS)
    ranks[1] = torch.tensor([0, 0, 5])  # takes 2: 3 tokens, next at row 4
    ranks[4] = torch.tensor([3, 0, 0])  # takes none: next at row 5
    ranks[5] = torch.tensor([0, 0, 0])  # takes 3: next at row 9
    ranks[9] = torch.tensor([0, RANKS, RANKS])  # takes 1 (past the sequence, no rank): next at row 11, the end
    steps, tokens, first = replay(ranks, torch.ones(12, 3), 2, chain(3, 0.0))
    assert (steps, tokens, first) == (4, 3 + 1 + 4 + 2, 3)
