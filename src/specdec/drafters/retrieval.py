"""`retrieval:DIR`: retrieval-based drafting from a corpus (after REST, He et al. 2023).

`specdec datastore build FILES... --out DIR` tokenizes a corpus with the target's tokenizer
and sorts it into a suffix array (see `specdec.datastore`). Each step finds the longest
suffix of the context in the corpus, reads the continuations of (up to `rows` of) its
occurrences, and proposes the most frequent one while its empirical path probability stays
above `min_prob`; with `tree=1` the likeliest branches form a token tree, best first.

Example: with the corpus "x = foo(1)\\ny = foo(2)" and the context "z = foo(", the match
"= foo(" has two continuations, "1)" and "2)": a chain proposes one of them, a tree both.

Options: `retrieval:DIR:tree=1:nodes=24:width=4:rows=64:min_prob=0.1:max_match=16`.
The drafter keeps no per-request state, so one instance may serve any number of requests.
"""

from __future__ import annotations

import threading

from specdec.drafters import Draft, Drafter, DrafterSpec, register
from specdec.drafters.datastore import Datastore, tokenizer_fingerprint
from specdec.errors import SpecdecError
from specdec.tree import best_first_tree

Rows = tuple[list[list[int]], int]  # continuations that share a prefix, and its length


class RetrievalDrafter(Drafter):
    name = "retrieval"

    def __init__(
        self,
        store: Datastore,
        rows: int = 64,
        min_prob: float = 0.1,
        max_match: int = 16,
        tree: bool = False,
        max_nodes: int = 24,
        width: int = 4,
        eos_token_ids: set[int] | None = None,
    ):
        self.store = store
        self.rows, self.min_prob, self.max_match = rows, min_prob, max_match
        self.tree, self.max_nodes, self.width = tree, max_nodes, width
        self.eos = eos_token_ids or set()

    def _children(self, state: Rows) -> list[tuple[float, int, Rows]]:
        """The distinct next tokens of rows sharing a prefix, likeliest first (top `width`)."""
        rows, depth = state
        if depth > 0 and rows[0][depth - 1] in self.eos:
            return []
        groups: dict[int, list[list[int]]] = {}
        for row in rows:
            if len(row) > depth:
                groups.setdefault(row[depth], []).append(row)
        ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[: self.width]
        total = len(rows)  # rows that end here count against every continuation
        return [(len(group) / total, token, (group, depth + 1)) for token, group in ranked]

    def propose(self, context_ids: list[int], k: int) -> Draft:
        if k <= 0 or not context_ids:
            return Draft([])
        match = self.store.longest_match(context_ids, self.max_match)
        if match.length == 0:
            return Draft([])
        rows = self.store.continuations(match, self.rows, k)
        if not rows:
            return Draft([])
        roots = self._children((rows, 0))
        if self.tree:
            tokens, parents, _ = best_first_tree(roots, self._children, self.max_nodes, k, self.min_prob)
            if all(p == i - 1 for i, p in enumerate(parents)):
                return Draft(tokens)
            return Draft(tokens, None, parents)
        tokens: list[int] = []
        prob = 1.0
        children = roots
        while children and len(tokens) < k:
            p, token, state = children[0]
            prob *= p
            if prob < self.min_prob:
                break
            tokens.append(token)
            children = self._children(state)
        return Draft(tokens)


_STORES: dict[str, Datastore] = {}
_STORES_LOCK = threading.Lock()


def open_datastore(directory: str, fingerprint: str) -> Datastore:
    """Load a datastore once per process (the arrays are memory-mapped and read-only)."""
    with _STORES_LOCK:
        store = _STORES.get(directory)
        if store is None:
            store = _STORES[directory] = Datastore(directory)
    if store.meta.get("tokenizer_fingerprint") != fingerprint:
        raise SpecdecError(
            f"datastore {directory!r} was built with another tokenizer "
            f"({store.meta.get('target', 'unknown target')}); rebuild it with the target's tokenizer",
            "drafter",
        )
    return store


@register("retrieval")
def _make(spec: DrafterSpec, target) -> Drafter:
    if not spec.arg:
        raise SpecdecError("the retrieval drafter needs a datastore: retrieval:DIR", "drafter")
    opts = dict(spec.options)
    try:
        kwargs = dict(
            rows=int(opts.pop("rows", 64)),
            min_prob=float(opts.pop("min_prob", 0.1)),
            max_match=int(opts.pop("max_match", 16)),
            tree=opts.pop("tree", "0") not in ("0", "false", "no"),
            max_nodes=int(opts.pop("nodes", 24)),
            width=int(opts.pop("width", 4)),
        )
        if opts:
            raise ValueError(f"unknown option(s) {', '.join(sorted(opts))}")
        if min(kwargs["rows"], kwargs["max_match"], kwargs["max_nodes"], kwargs["width"]) < 1:
            raise ValueError("rows, max_match, nodes and width must be >= 1")
        if not 0.0 <= kwargs["min_prob"] <= 1.0:
            raise ValueError("min_prob must be in [0, 1]")
    except ValueError as e:
        raise SpecdecError(f"bad retrieval options in {spec.text!r}: {e}", "drafter") from e
    store = open_datastore(spec.arg, tokenizer_fingerprint(target.tokenizer))
    return RetrievalDrafter(store, eos_token_ids=set(getattr(target, "eos_token_ids", set())), **kwargs)
