"""`suffix`: suffix decoding (after SuffixDecoding, Oliaro et al. 2024).

Two suffix tries, each holding every substring of up to `depth` tokens of its documents with
occurrence counts:
- a per-request one over the prompt and the output so far, extended as tokens are accepted;
- a global one over the outputs of earlier requests, shared by every `suffix` drafter of the
  process (behind a lock) and bounded in nodes: the oldest requests are evicted first. The
  server keeps one per tenant (`Drafter.scope`), so callers never learn each other's text.

A proposal starts, in each trie, at the longest suffix of the context that has been followed
by something before, and follows the most frequent continuation while the path's empirical
probability (the product of count(child) / count(continuations of parent)) stays above
`min_prob`; where the tries disagree, the continuation either deems likelier wins. The draft
is at most `factor` x the match length, so short, weak matches draft little. With `tree=1`
the likeliest alternatives also enter, best first, as branches of a token tree of at most
`nodes` nodes; a branch needs a path probability of at least `branch_prob`, since on a
CPU every scored token costs time.

Example: after the context [7 8 9 1 2 7 8], the suffix [7 8] was followed by 9 once, so the
drafter proposes [9 1 2 ...].

Updating a trie costs O(depth) dictionary operations per token; matching is incremental
through suffix links, so a step never rescans the context.

Usage: `suffix`, `suffix:tree=1:nodes=24:width=4:branch_prob=0.3`,
`suffix:depth=24:min_prob=0.1:factor=2:global_nodes=400000`, `suffix:global=0`.
One drafter instance serves one request at a time (it holds that request's trie); create one
per concurrent request: all drafters made from the same spec string share the global trie.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict, deque

from specdec.drafters import Draft, Drafter, DrafterSpec, register
from specdec.errors import SpecdecError
from specdec.tree import best_first_tree

ROOT = 0


class SuffixTrie:
    """Every substring of up to `depth` tokens of the inserted documents, with counts.

    Node arrays: kids (token -> child), count (occurrences of the node's string), cont
    (occurrences followed by another token: the sum of the children's counts), link (the
    node of the string without its first token), dep (string length), parent and token.
    A document is fed token by token through an `active` list: the nodes of its current
    suffixes of lengths 0..depth-1, shortest first.
    """

    def __init__(self, depth: int):
        if depth < 2:
            raise ValueError(f"depth must be >= 2, got {depth}")
        self.depth = depth
        self.kids: list[dict[int, int] | None] = [None]
        self.count = [0]
        self.cont = [0]
        self.link = [ROOT]
        self.dep = [0]
        self.parent = [-1]
        self.token = [-1]
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        return len(self.count) - len(self._free) - 1

    def _new_node(self, parent: int, token: int, link: int) -> int:
        if self._free:
            node = self._free.pop()
            self.kids[node], self.count[node], self.cont[node] = None, 0, 0
            self.link[node], self.dep[node] = link, self.dep[parent] + 1
            self.parent[node], self.token[node] = parent, token
            return node
        self.kids.append(None)
        self.count.append(0)
        self.cont.append(0)
        self.link.append(link)
        self.dep.append(self.dep[parent] + 1)
        self.parent.append(parent)
        self.token.append(token)
        return len(self.count) - 1

    def extend(self, active: list[int], token: int) -> list[int]:
        """Append `token` to the document whose suffix nodes are `active`; return the new list."""
        kids, count, cont, dep, limit = self.kids, self.count, self.cont, self.dep, self.depth
        new = [ROOT]
        shorter = ROOT  # the node just made for the next shorter suffix: the suffix link
        for node in active:
            children = kids[node]
            if children is None:
                children = kids[node] = {}
            child = children.get(token)
            if child is None:
                child = children[token] = self._new_node(node, token, shorter)
            count[child] += 1
            cont[node] += 1
            if dep[child] < limit:
                new.append(child)
            shorter = child
        return new

    def insert(self, doc: list[int]) -> None:
        active = [ROOT]
        for token in doc:
            active = self.extend(active, token)

    def remove(self, doc: list[int]) -> None:
        """Undo `insert(doc)`: decrement the same counts, then free the nodes left at zero."""
        kids, count, cont, dep, limit = self.kids, self.count, self.cont, self.dep, self.depth
        dead: list[int] = []
        active = [ROOT]
        for token in doc:
            new = [ROOT]
            for node in active:
                child = kids[node][token]  # type: ignore[index]
                count[child] -= 1
                cont[node] -= 1
                if count[child] == 0:
                    dead.append(child)
                if dep[child] < limit:
                    new.append(child)
            active = new
        # Deleted only now, since the walk above still passed through them. A dead node's
        # descendants and the nodes linking to it are dead too (their counts are smaller).
        dead_set = set(dead)
        for node in dead:
            parent = self.parent[node]
            if parent not in dead_set:
                children = kids[parent]
                del children[self.token[node]]  # type: ignore[union-attr]
                if not children:
                    kids[parent] = None
            kids[node] = None
            self._free.append(node)

    def step(self, node: int, token: int) -> int:
        """Aho-Corasick step: the longest suffix of (node's string + token) that is a node."""
        kids, dep, link, limit = self.kids, self.dep, self.link, self.depth
        while True:
            if dep[node] < limit:
                children = kids[node]
                if children is not None:
                    child = children.get(token)
                    if child is not None:
                        return child
            if node == ROOT:
                return ROOT
            node = link[node]

    def anchor(self, node: int) -> int:
        """The longest suffix of node's string that has been continued (ROOT when none)."""
        while node != ROOT and not self.kids[node]:
            node = self.link[node]
        return node

    def top_children(self, node: int, width: int) -> list[tuple[float, int, int]]:
        node = self.anchor(node)
        if node == ROOT:
            return []
        children, count, total = self.kids[node], self.count, self.cont[node]
        assert children
        if len(children) == 1 or width == 1:
            token, child = max(children.items(), key=lambda kv: count[kv[1]])
            return [(count[child] / total, token, child)]
        ranked = sorted(children.items(), key=lambda kv: -count[kv[1]])[:width]
        return [(count[child] / total, token, child) for token, child in ranked]


def merged_tree(
    sources: list[tuple[SuffixTrie, int]],
    max_depth: int,
    max_nodes: int,
    width: int,
    min_prob: float,
    branch_prob: float,
    eos: set[int],
) -> tuple[list[int], list[int], float]:
    """A best-first draft tree over the continuations of several (trie, node) matches.

    A tree node stands for the same token sequence in every trie that has it; its children
    are the union of those tries' top children, each with the largest probability any of
    them gives it.
    """

    def expand(state: tuple[int, tuple[tuple[SuffixTrie, int], ...]]) -> list[tuple[float, int, object]]:
        token, pairs = state
        if token in eos:  # never draft past the end of a turn
            return []
        merged: dict[int, list] = {}
        for trie, node in pairs:
            for prob, child_token, child in trie.top_children(node, width):
                entry = merged.setdefault(child_token, [0.0, []])
                entry[0] = max(entry[0], prob)
                entry[1].append((trie, child))
        ranked = sorted(merged.items(), key=lambda kv: -kv[1][0])[:width]
        return [(prob, child_token, (child_token, tuple(pairs))) for child_token, (prob, pairs) in ranked]

    roots = expand((-1, tuple(sources)))
    return best_first_tree(roots, expand, max_nodes, max_depth, min_prob, branch_prob)


class SuffixStore:
    """The trie over earlier requests' outputs (of one tenant), bounded in nodes (FIFO eviction).

    `version` changes whenever the trie does, so a request's cursor into it knows when to
    re-match instead of trusting a node that may have been freed.
    """

    def __init__(self, depth: int, max_nodes: int, group: TenantStores | None = None):
        self.trie = SuffixTrie(depth)
        self.max_nodes = max_nodes
        self.lock = threading.Lock()
        self.docs: deque[list[int]] = deque()
        self.version = 0
        self.group = group  # the tenants' stores this one is bounded with

    def add(self, doc: list[int]) -> None:
        if len(doc) < 2:
            return
        with self.lock:
            self.trie.insert(doc)
            self.docs.append(doc)
            while self.trie.num_nodes > self.max_nodes and self.docs:
                self.trie.remove(self.docs.popleft())
            self.version += 1
        if self.group is not None:
            self.group.trim(keep=self)


class TenantStores:
    """One `SuffixStore` per tenant (an API key, plus a request's `cache_salt`), so that what
    one caller sent or received never shapes another caller's drafts, nor the acceptance its
    responses report. Bounded together: past `max_nodes` nodes in all, the stores of the least
    recently served tenants are dropped whole."""

    def __init__(self, depth: int, max_nodes: int):
        self.depth, self.max_nodes = depth, max_nodes
        self._stores: OrderedDict[str, SuffixStore] = OrderedDict()  # least recently served first
        self._lock = threading.Lock()

    def get(self, tenant: str = "") -> SuffixStore:
        with self._lock:
            store = self._stores.get(tenant)
            if store is None:
                store = self._stores[tenant] = SuffixStore(self.depth, self.max_nodes, self)
            self._stores.move_to_end(tenant)
            return store

    def trim(self, keep: SuffixStore) -> None:
        with self._lock:
            total = sum(store.trie.num_nodes for store in self._stores.values())
            for tenant, store in list(self._stores.items()):
                if total <= self.max_nodes:
                    break
                if store is not keep:
                    total -= store.trie.num_nodes
                    del self._stores[tenant]

    def __len__(self) -> int:
        return len(self._stores)


_STORES: dict[tuple[str, str], TenantStores] = {}
_STORES_LOCK = threading.Lock()


def shared_store(target: str, spec: str, depth: int, max_nodes: int) -> TenantStores:
    """One set of tenant stores per (target, drafter spec string) for the whole process: every
    drafter made from the same spec shares it, while differently configured ones (say, two
    methods in one benchmark) never see each other's outputs."""
    with _STORES_LOCK:
        stores = _STORES.get((target, spec))
        if stores is None:
            stores = _STORES[(target, spec)] = TenantStores(depth, max_nodes)
        return stores


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(
        self,
        store: SuffixStore | None,
        depth: int = 24,
        min_prob: float = 0.1,
        factor: float = 2.0,
        tree: bool = False,
        max_nodes: int = 24,
        width: int = 4,
        eos_token_ids: set[int] | None = None,
        prompt_tail: int = 8,
        branch_prob: float = 0.3,
        stores: TenantStores | None = None,
    ):
        if store is not None and store.trie.depth != depth:
            raise ValueError("the global store was built with another depth")
        self.store = store
        self.stores = stores  # where `scope` finds a tenant's store; None: `store` serves everyone
        self.depth, self.min_prob, self.factor = depth, min_prob, factor
        self.tree, self.max_nodes, self.width, self.branch_prob = tree, max_nodes, width, branch_prob
        self.eos = eos_token_ids or set()
        self.prompt_tail = prompt_tail  # prompt tokens stored before an output, to match its start
        self._reset([])

    def _reset(self, prompt_ids: list[int]) -> None:
        self.local = SuffixTrie(self.depth)
        self._active = [ROOT]
        self._doc: list[int] = []
        self._prompt_len = len(prompt_ids)
        self._gnode, self._gversion = ROOT, -1

    def scope(self, tenant: str) -> None:
        if self.stores is not None:
            self.store = self.stores.get(tenant)
            self._gnode, self._gversion = ROOT, -1

    def begin(self, prompt_ids, params, generator) -> None:
        self._reset(prompt_ids)
        self._sync(prompt_ids)

    def _sync(self, context: list[int]) -> None:
        """Feed the tokens of `context` not seen yet to the request trie and the global cursor."""
        n = len(self._doc)
        tail = max(0, n - self.depth)
        if len(context) < n or context[tail:n] != self._doc[tail:]:  # not our request: start over
            self._reset(context)
            n = 0
        new = context[n:]
        for token in new:
            self._active = self.local.extend(self._active, token)
        self._doc.extend(new)
        if self.store is not None:
            with self.store.lock:
                trie = self.store.trie
                if self._gversion != self.store.version:  # the trie changed: match again
                    self._gnode, self._gversion = ROOT, self.store.version
                    new = context[-self.depth :]
                for token in new:
                    self._gnode = trie.step(self._gnode, token)

    def on_verified(self, context_ids, num_accepted) -> None:
        self._sync(context_ids)

    def propose(self, context_ids: list[int], k: int) -> Draft:
        if k <= 0 or not context_ids:
            return Draft([])
        self._sync(context_ids)
        sources = [(self.local, self.local.anchor(self._active[-1]))]
        if self.store is None:
            tokens, parents = self._draft(sources, k)
        else:
            with self.store.lock:
                sources.append((self.store.trie, self.store.trie.anchor(self._gnode)))
                tokens, parents = self._draft(sources, k)
        if all(p == i - 1 for i, p in enumerate(parents)):
            return Draft(tokens)  # a tree without branches is a chain
        return Draft(tokens, None, parents)

    def _draft(self, sources: list[tuple[SuffixTrie, int]], k: int) -> tuple[list[int], list[int]]:
        sources = [(trie, node) for trie, node in sources if node != ROOT]
        if not sources:
            return [], []
        # Draft at most factor x the match length: short matches predict little.
        depth = min(k, max(1, math.ceil(self.factor * max(trie.dep[node] for trie, node in sources))))
        if not self.tree:  # a chain: the tree's main line, without branches
            return merged_tree(sources, depth, depth, 1, self.min_prob, math.inf, self.eos)[:2]
        return merged_tree(sources, depth, self.max_nodes, self.width, self.min_prob, self.branch_prob,
                           self.eos)[:2]

    def end(self, context_ids: list[int]) -> None:
        if self.store is not None:
            start = max(0, self._prompt_len - self.prompt_tail)
            self.store.add(list(context_ids[start:]))


@register("suffix")
def _make(spec: DrafterSpec, target) -> Drafter:
    opts = dict(spec.options)
    try:
        depth = int(opts.pop("depth", 24))
        kwargs = dict(
            min_prob=float(opts.pop("min_prob", 0.1)),
            factor=float(opts.pop("factor", 2.0)),
            tree=opts.pop("tree", "0") not in ("0", "false", "no"),
            max_nodes=int(opts.pop("nodes", 24)),
            width=int(opts.pop("width", 4)),
            branch_prob=float(opts.pop("branch_prob", 0.3)),
        )
        use_global = opts.pop("global", "1") not in ("0", "false", "no")
        global_nodes = int(opts.pop("global_nodes", 400_000))
        if opts:
            raise ValueError(f"unknown option(s) {', '.join(sorted(opts))}")
        if not 2 <= depth <= 256 or not 0.0 <= kwargs["min_prob"] <= 1.0 or kwargs["factor"] <= 0:
            raise ValueError("need 2 <= depth <= 256, 0 <= min_prob <= 1 and factor > 0")
        if kwargs["max_nodes"] < 1 or kwargs["width"] < 1 or global_nodes < 1:
            raise ValueError("nodes, width and global_nodes must be >= 1")
    except ValueError as e:
        raise SpecdecError(f"bad suffix options in {spec.text!r}: {e}", "drafter") from e
    stores = shared_store(getattr(target, "name", ""), spec.text, depth, global_nodes) if use_global else None
    eos = set(getattr(target, "eos_token_ids", set()))
    return SuffixDrafter(stores.get() if stores is not None else None, depth, eos_token_ids=eos,
                         stores=stores, **kwargs)
