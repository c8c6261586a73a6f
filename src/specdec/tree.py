"""Token trees: helpers, verification, and the tree step. Verification is pure functions.

A draft tree is a list of tokens plus `parents`: parents[i] is the index of token i's parent,
or -1 when token i hangs off the pending token (the last token of the sequence, not yet in
the cache). Parents come before their children (parents[i] < i), so any prefix of the lists
is again a tree.

The target scores [pending, *tokens] in one forward with a tree attention mask. Its logits
row 0 is the distribution after the pending token (it verifies the roots); row i + 1 is the
distribution after draft node i (it verifies node i's children). Verification walks down
from the pending token and keeps one root-to-leaf path.

Example: tokens [5, 7, 6, 9], parents [-1, -1, 0, 0] is the tree

    pending ─┬─ 5 ─┬─ 6
             │     └─ 9
             └─ 7

whose chains are [5, 6], [5, 9] and [7].
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from specdec.sampling import Draws, as_draws, logits_to_probs, sample_at
from specdec.verify import residual_distribution


class TreeCache(Protocol):
    """What the tree step needs of a backend (backends.Backend has it): keeping one path."""

    def keep(self, indices: list[int]) -> None: ...


def check_tree(parents: list[int]) -> None:
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"bad token tree: parents[{i}] = {p}; a parent must come before its child")


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each node; roots (parent -1) have depth 0."""
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def tree_children(parents: list[int]) -> list[list[int]]:
    """children[i] for i in range(n), plus children[n] = the roots, in node order."""
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, p in enumerate(parents):
        children[p if p >= 0 else len(parents)].append(i)
    return children


def tree_path(parents: list[int], node: int) -> list[int]:
    """Node indices from the root down to `node` (inclusive); [] for node -1."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def first_path(parents: list[int]) -> list[int]:
    """The chain that follows the first root, then each node's first child.

    Drafters list the likeliest branch first, so this is the tree's best single chain; it
    is what a backend without tree attention verifies instead of the whole tree.
    """
    path, node = [], -1
    for i, p in enumerate(parents):
        if p == node:
            path.append(i)
            node = i
    return path


def depth_first(parents: list[int]) -> list[int]:
    """The nodes in depth-first preorder: each node comes after its parent, and a subtree's
    nodes come together, so walking them keeps the current root-to-node path on a stack."""
    children = tree_children(parents)
    order: list[int] = []
    stack = list(reversed(children[len(parents)]))
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(reversed(children[node]))
    return order


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[T, T] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]  # parents come first, so row p is already complete
    return mask


def prune_tree(parents: list[int], max_depth: int, max_nodes: int) -> list[int]:
    """Indices of the nodes to keep: depth < max_depth, at most max_nodes, ancestors closed."""
    keep: list[int] = []
    kept: set[int] = set()
    for i, d in enumerate(tree_depths(parents)):
        if len(keep) >= max_nodes:
            break
        if d < max_depth and (parents[i] < 0 or parents[i] in kept):
            keep.append(i)
            kept.add(i)
    return keep


def subtree(tokens: list[int], parents: list[int], keep: list[int]) -> tuple[list[int], list[int]]:
    """Tokens and re-indexed parents of the kept nodes (`keep` sorted, ancestor-closed)."""
    new_index = {old: new for new, old in enumerate(keep)}
    return [tokens[i] for i in keep], [new_index[parents[i]] if parents[i] >= 0 else -1 for i in keep]


@dataclass(frozen=True)
class TreeVerifyResult:
    accepted: list[int]  # draft node indices on the accepted path, root first
    next_token: int  # the recovered token, or the bonus token below the last accepted node
    num_drafted: int  # nodes in the tree

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    def emitted(self, draft_tokens: list[int]) -> list[int]:
        return [draft_tokens[i] for i in self.accepted] + [self.next_token]


def verify_tree_greedy(draft_tokens: list[int], parents: list[int],
                       target_argmax: torch.Tensor) -> TreeVerifyResult:
    """Follow the target's argmax down the tree.

    draft_tokens:  [n] node tokens; parents: [n]
    target_argmax: [n+1] the target's choice after the pending token (row 0) and after each
                   node's path (row i + 1)
    """
    children = tree_children(parents)
    argmax = target_argmax.tolist()
    accepted: list[int] = []
    node = -1
    while True:
        want = argmax[node + 1]
        kids = children[node if node >= 0 else len(parents)]
        match = next((c for c in kids if draft_tokens[c] == want), None)
        if match is None:
            return TreeVerifyResult(accepted, want, len(parents))
        accepted.append(match)
        node = match


def verify_tree_sampling(
    draft_tokens: list[int],
    parents: list[int],
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    draws: Draws | torch.Generator | None,
    position: int = 0,
) -> TreeVerifyResult:
    """Speculative sampling down a token tree.

    draft_tokens: [n]; parents: [n]
    draft_probs:  [n, V] the distribution node i was drawn from (siblings drawn independently),
                  or None for a deterministic drafter (each node one-hot on its token)
    target_probs: [n+1, V] the target's processed distributions, row 0 after the pending token,
                  row i + 1 after node i's path
    draws, position: the request's draws and the output position of the roots (verify.py)

    A deterministic tree is walked like the greedy one, with the target's own sample at each
    depth (`sample_at`) in place of its argmax: the child that equals it is accepted, and
    when none does the sample is the next token. Soft trees use recursive rejection sampling
    over siblings (SpecInfer's multi-step speculative sampling): at a node, each child in
    turn is accepted with prob min(1, p(x) / q(x)) under the current target distribution p;
    a rejected child turns p into the residual norm(max(p - q, 0)) before the next sibling is
    tried, and when every child is rejected the next token is drawn from the residual. Each
    sibling trial is one exact rejection step for the distribution left by the earlier ones,
    so either way the emitted tokens are distributed as the target's own samples.
    """
    draws = as_draws(draws)
    children = tree_children(parents)
    accepted: list[int] = []
    node = -1
    while True:
        at = position + len(accepted)  # the output position this depth decides
        kids = children[node if node >= 0 else len(parents)]
        if draft_probs is None:
            token = sample_at(target_probs[node + 1], draws, at)
            child = next((c for c in kids if draft_tokens[c] == token), None)
        else:
            child, token = _sibling_rejection(kids, draft_tokens, draft_probs, target_probs[node + 1],
                                              draws, at)
        if child is None:
            return TreeVerifyResult(accepted, token, len(parents))
        accepted.append(child)
        node = child


def _sibling_rejection(kids, draft_tokens, draft_probs, target_row, draws, at) -> tuple[int | None, int]:
    """Try the soft-drafted siblings `kids` in turn against target_row [V]; return (the
    accepted child, its token) or (None, a token drawn from what the rejections left)."""
    residual = target_row  # [V]
    uniforms = draws.uniforms(at, len(kids)).tolist()
    for child, uniform in zip(kids, uniforms, strict=True):
        token = draft_tokens[child]
        draft_row = draft_probs[child]  # [V]
        accept_p = min(1.0, float(residual[token]) / max(float(draft_row[token]), 1e-30))
        if uniform < accept_p:
            return child, token
        residual = residual_distribution(residual, draft_row, token)
    return None, sample_at(residual, draws, at)


# ---- the tree step: the engine feeds [pending, *tokens] with parents [-1, *(p + 1)] -------


def keep_path(backend: TreeCache, accepted: list[int]) -> None:
    """Keep the pending token and the accepted nodes in the backend's cache."""
    backend.keep([0, *[i + 1 for i in accepted]])


def best_first_tree(
    roots: list[tuple[float, int, object]],
    expand,
    max_nodes: int,
    max_depth: int,
    min_prob: float,
    branch_prob: float | None = None,
) -> tuple[list[int], list[int], float]:
    """Grow a draft tree by always adding the likeliest open candidate (Sequoia/SuffixDecoding).

    roots: (probability, token, state) candidates below the pending token, likeliest first;
    expand(state) returns the same for a node's children, with probabilities conditional on
    that node. A candidate enters while its path probability is >= min_prob, or >= branch_prob
    when it is not its parent's likeliest child: a branch costs a scored token like any node,
    so it may be held to a higher bar than the main line. Returns (tokens, parents, score),
    score = sum of path probabilities, the expected number of accepted tokens if the
    probabilities are calibrated. Children are added in order of probability, so each node's
    first child is its likeliest (see `first_path`).
    """
    bar = max(min_prob, branch_prob if branch_prob is not None else min_prob)
    heap: list[tuple[float, int, int, int, int, object]] = []  # (-p, seq, parent, depth, token, state)
    seq = 0

    def offer(candidates: list[tuple[float, int, object]], prob: float, parent: int, depth: int) -> None:
        nonlocal seq
        for rank, (p, token, state) in enumerate(candidates):
            path_p = prob * p
            if path_p >= (min_prob if rank == 0 else bar):
                heapq.heappush(heap, (-path_p, seq, parent, depth, token, state))
                seq += 1

    offer(roots, 1.0, -1, 0)
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    while heap and len(tokens) < max_nodes:
        neg_p, _, parent, depth, token, state = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        score -= neg_p
        if depth + 1 < max_depth:
            offer(expand(state), -neg_p, len(tokens) - 1, depth + 1)
    return tokens, parents, score


def fit_tree(draft, max_depth: int, max_nodes: int, use_tree: bool):
    """Cut a drafter's tree to what this step may score (depth <= max_depth, at most max_nodes
    nodes); without tree scoring, keep its best chain (`first_path`). Returns a Draft whose
    `parents` is None when what is left is a chain."""
    parents = draft.parents
    keep = prune_tree(parents, max_depth, max_nodes) if use_tree else first_path(parents)[:max_depth]
    tokens, parents = subtree(draft.tokens, parents, keep)
    probs = draft.probs[keep] if draft.probs is not None and keep else None
    if all(p == i - 1 for i, p in enumerate(parents)):
        parents = None
    # a copy of the drafter's Draft: this module stays below the drafters, which import it
    return replace(draft, tokens=tokens, probs=probs, parents=parents)


def tree_depth(parents: list[int]) -> int:
    """Tokens on the longest root-to-leaf path (0 for an empty tree)."""
    return max(tree_depths(parents), default=-1) + 1


def verify_tree(draft_tokens, parents, draft_probs, logits, params, draws,
                position: int = 0) -> TreeVerifyResult:
    """Greedy or sampling tree verification from the target's logits [n+1, V]; the roots
    decide output position `position`."""
    if params.greedy:
        return verify_tree_greedy(draft_tokens, parents, logits.argmax(-1))
    target_probs = logits_to_probs(logits, params)
    return verify_tree_sampling(draft_tokens, parents, draft_probs, target_probs, draws, position)
