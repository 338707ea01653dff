"""The suffix trie as first written, every substring a node: the oracle that proposers/suffix_tree.py's trie,
which makes nodes only where counts branch, must draft exactly like (tests/test_suffix.py)."""

from specdecode.proposers.suffix_tree import POSITION_BITS, Draft


class FullTrie:
    def __init__(self, depth: int):
        self.depth, self.counts, self.children, self.last_end = depth, [0], [None], [0]

    def extend(self, tokens, text_id=0, start=0, open_nodes=None):
        nodes, position = open_nodes or [], (text_id << POSITION_BITS) + start
        for token in tokens:
            grown = []
            for parent in [0] + nodes[: self.depth - 1]:
                kids = self.children[parent] = self.children[parent] or {}
                if token not in kids:
                    kids[token] = len(self.counts)
                    self.counts.append(0)
                    self.children.append(None)
                    self.last_end.append(0)
                node = kids[token]
                self.counts[node] += 1
                self.last_end[node] = position
                grown.append(node)
            nodes, position = grown, position + 1
        return nodes

    def remove(self, tokens):
        nodes = []
        for token in tokens:
            grown = []
            for parent in [0] + nodes[: self.depth - 1]:
                node = self.children[parent][token]
                self.counts[node] -= 1
                if self.counts[node] == 0:
                    del self.children[parent][token]
                    if not self.children[parent]:
                        self.children[parent] = None
                grown.append(node)
            nodes = grown

    def longest_continued(self, context):
        best = (0, 0)
        for m in range(1, min(self.depth - 1, len(context)) + 1):
            node = 0
            for token in context[len(context) - m :]:
                node = (self.children[node] or {}).get(token)
                if node is None:
                    break
            if node is None or self.children[node] is None:
                break
            best = (node, m)
        return best

    def draft_from(self, node, match, max_tokens, min_prob, text):
        draft, p, counts = Draft(match=match), 1.0, self.counts
        while len(draft.tokens) < max_tokens and self.children[node] is not None:
            kids = self.children[node]
            token, child = max(kids.items(), key=lambda item: counts[item[1]])
            q = counts[child] / sum(counts[c] for c in kids.values())
            if p * q < min_prob:
                break
            p *= q
            draft.tokens.append(token)
            draft.probs.append(q)
            node = child
            if counts[child] == 1 or self.children[child] is None:
                text_id, end = divmod(self.last_end[child], 1 << POSITION_BITS)
                tokens = text(text_id)
                if tokens is not None:
                    copied = list(tokens[end + 1 : end + 1 + max_tokens - len(draft.tokens)])
                    draft.tokens += copied
                    draft.probs += [1.0] * len(copied)
                    draft.source = text_id
                break
        return draft
