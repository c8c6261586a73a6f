"""The `suffix` drafter: its tries, proposals, the shared global store, and greedy losslessness."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import spy_trees, tiny_llama
from specdec import Engine, SpecdecError
from specdec.drafters import make_drafter
from specdec.drafters.suffix import ROOT, SuffixDrafter, SuffixStore, SuffixTrie
from specdec.sampling import SamplingParams
from specdec.tree import first_path, tree_depths


def _node(trie: SuffixTrie, string: list[int]) -> int | None:
    node = ROOT
    for token in string:
        node = (trie.kids[node] or {}).get(token)
        if node is None:
            return None
    return node


def _counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every string in the trie with its count (a canonical form to compare tries)."""
    out, stack = {}, [(ROOT, ())]
    while stack:
        node, string = stack.pop()
        for token, child in (trie.kids[node] or {}).items():
            assert trie.count[child] > 0
            out[string + (token,)] = trie.count[child]
            stack.append((child, string + (token,)))
    return out


def _brute_counts(docs: list[list[int]], depth: int) -> dict[tuple[int, ...], int]:
    out: dict[tuple[int, ...], int] = {}
    for doc in docs:
        for i in range(len(doc)):
            for j in range(i + 1, min(len(doc), i + depth) + 1):
                out[tuple(doc[i:j])] = out.get(tuple(doc[i:j]), 0) + 1
    return out


def test_trie_counts_links_and_continuations():
    trie = SuffixTrie(depth=4)
    trie.insert([1, 2, 3, 1, 2, 4])
    assert _counts(trie) == _brute_counts([[1, 2, 3, 1, 2, 4]], 4)
    node = _node(trie, [1, 2])
    assert trie.count[node] == 2 and trie.cont[node] == 2  # followed by 3 and by 4
    assert trie.link[_node(trie, [3, 1, 2])] == node  # [3 1 2] without its first token
    assert trie.step(_node(trie, [2, 3, 1, 2]), 4) == _node(trie, [3, 1, 2, 4])  # depth-capped


@settings(max_examples=40, deadline=None)
@given(
    docs=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=12), min_size=1, max_size=6),
    data=st.data(),
)
def test_trie_remove_undoes_insert(docs, data):
    """Inserting documents and removing some leaves exactly the trie of the others."""
    trie = SuffixTrie(depth=3)
    for doc in docs:
        trie.insert(doc)
    removed = data.draw(st.sets(st.integers(0, len(docs) - 1)))
    for i in sorted(removed):
        trie.remove(docs[i])
    kept = [d for i, d in enumerate(docs) if i not in removed]
    assert _counts(trie) == _brute_counts(kept, 3)
    assert trie.num_nodes == len(_brute_counts(kept, 3))
    for doc in kept:  # freed nodes get reused without corrupting links
        trie.insert(doc)
    assert _counts(trie) == _brute_counts(kept + kept, 3)


@pytest.mark.parametrize(
    ("context", "options", "expected"),
    [
        # [7 8] was followed by 9 1 2; a 2-token match drafts up to factor x 2 = 4 tokens.
        ([7, 8, 9, 1, 2, 7, 8], {}, [9, 1, 2, 7]),
        # The longest match wins: [5 1] was followed by 3, while [1] alone mostly by 2.
        ([1, 2, 1, 2, 1, 2, 5, 1, 3, 0, 5, 1], {"factor": 1.0}, [3, 0]),
        # Never past the end of a turn.
        ([4, 5, 6, 99, 8, 4, 5], {}, [6, 99]),
        # Two equally frequent continuations: probability 0.5 stays under min_prob=0.6.
        ([1, 2, 1, 3, 1], {"min_prob": 0.6}, []),
        # No earlier occurrence of any suffix: nothing to propose.
        ([1, 2, 3, 4], {}, []),
    ],
)
def test_proposals(context, options, expected):
    drafter = SuffixDrafter(None, depth=8, eos_token_ids={99}, **options)
    drafter.begin(context, SamplingParams(), None)
    assert drafter.propose(context, 8).tokens == expected


def test_draft_follows_the_context_as_it_grows():
    text = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]
    context = text + [0] + text[:4]
    drafter = SuffixDrafter(None, depth=24)
    drafter.begin(context, SamplingParams(), None)
    assert drafter.propose(context, 4).tokens == text[4:8]
    context += text[4:7]  # three accepted, then a token the draft did not predict
    context.append(42)
    drafter.on_verified(context, 3)
    assert drafter.propose(context, 4).tokens == []  # [.. 9 2 42] never occurred
    # A context that does not extend the indexed one (another request): rebuilt from it.
    assert drafter.propose(text[:10], 4).tokens == [1, 4]  # [3] was followed by [1 4 ...]


def test_tree_branches_on_ambiguity_best_first():
    # [1 2] was followed by 3 three times and by 4 once: both branches, the likelier first.
    context = [1, 2, 3, 7, 5, 1, 2, 3, 7, 6, 1, 2, 4, 8, 9, 1, 2, 3, 7, 0, 1, 2]
    drafter = SuffixDrafter(None, depth=8, tree=True, max_nodes=8, min_prob=0.1, branch_prob=0.1)
    drafter.begin(context, SamplingParams(), None)
    draft = drafter.propose(context, 3)
    assert draft.parents is not None and len(draft.tokens) == 8
    assert [t for t, p in zip(draft.tokens, draft.parents, strict=True) if p == -1] == [3, 4]
    assert [draft.tokens[i] for i in first_path(draft.parents)] == [3, 7, 5]  # the best chain first
    assert max(tree_depths(draft.parents)) < 3  # depth stays within k
    # A branch must reach branch_prob: the 1-in-4 continuation stays out, the main line stays.
    strict = SuffixDrafter(None, depth=8, tree=True, max_nodes=8, min_prob=0.1, branch_prob=0.3)
    strict.begin(context, SamplingParams(), None)
    assert strict.propose(context, 3).tokens == [3, 7, 5]


def test_global_store_learns_across_requests_and_evicts():
    store = SuffixStore(depth=8, max_nodes=60)
    first = SuffixDrafter(store, depth=8)
    prompt = [50, 51, 52]
    first.begin(prompt, SamplingParams(), None)
    first.end(prompt + [10, 11, 12, 13, 14, 15])
    second = SuffixDrafter(store, depth=8)
    other_prompt = [60, 61, 51, 52]  # a different request ending like the first one's prompt
    second.begin(other_prompt, SamplingParams(), None)
    assert second.propose(other_prompt, 8).tokens == [10, 11, 12, 13]  # 2 x the 2-token match
    second.on_verified(other_prompt + [10, 11, 12], 2)
    assert second.propose(other_prompt + [10, 11, 12], 8).tokens == [13, 14, 15]
    for i in range(10):  # unrelated traffic pushes the first output out
        second.begin([i], SamplingParams(), None)
        second.end([i] + [100 + 10 * i + j for j in range(8)])
        assert store.trie.num_nodes <= 60
    second.begin(other_prompt, SamplingParams(), None)
    assert second.propose(other_prompt, 8).tokens == []


def test_global_store_is_safe_under_concurrency():
    store = SuffixStore(depth=6, max_nodes=400)
    errors: list[BaseException] = []
    rng = random.Random(0)
    docs = [[rng.randrange(20) for _ in range(30)] for _ in range(40)]

    def worker(seed: int) -> None:
        try:
            drafter = SuffixDrafter(store, depth=6)
            for doc in docs[seed::4]:
                drafter.begin(doc[:5], SamplingParams(), None)
                for end in range(6, len(doc)):
                    drafter.propose(doc[:end], 6)
                drafter.end(doc)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert store.trie.num_nodes <= 400
    assert _counts(store.trie) == _brute_counts(list(store.docs), 6)


def test_factory_options_and_errors():
    target = tiny_llama(seed=0)
    drafter = make_drafter("suffix:depth=16:tree=1:nodes=12:min_prob=0.2", target)
    assert isinstance(drafter, SuffixDrafter) and drafter.tree and drafter.max_nodes == 12
    for bad in ("suffix:depth=1", "suffix:min_prob=2", "suffix:colour=red", "suffix:nodes=x"):
        with pytest.raises(SpecdecError, match="bad suffix options"):
            make_drafter(bad, target)


def test_propose_cost_on_a_4k_context():
    """Reports the drafting cost (not asserted: timings belong to benchmarks)."""
    rng = random.Random(0)
    phrases = [[rng.randrange(49152) for _ in range(rng.randrange(5, 40))] for _ in range(60)]
    context: list[int] = []
    while len(context) < 4600:
        context += rng.choice(phrases) + [rng.randrange(49152)]
    store = SuffixStore(depth=24, max_nodes=400_000)
    store.add(context[:2000])
    drafter = SuffixDrafter(store, depth=24)
    drafter.begin(context[:4096], SamplingParams(), None)
    times, pos, drafted = [], 4096, 0
    while pos < 4600:
        start = time.perf_counter()
        draft = drafter.propose(context[:pos], 8)
        times.append(time.perf_counter() - start)
        drafted += len(draft)
        accepted = next((i for i, t in enumerate(draft.tokens) if context[pos + i : pos + i + 1] != [t]),
                        len(draft))
        pos += accepted + 1
    assert drafted > 0
    times.sort()
    print(f"suffix propose on a 4k context: median {1e6 * times[len(times) // 2]:.0f} us, "
          f"p90 {1e6 * times[int(0.9 * len(times))]:.0f} us over {len(times)} steps")


# ---- greedy losslessness end to end -------------------------------------------------------

MAX_NEW = 40


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0)


def _plain(target, prompt, backend="hf"):
    engine = Engine(target=target, drafter="none", k=0, backend=backend)
    return engine.generate(prompt, max_new_tokens=MAX_NEW, chat=False)


@pytest.mark.parametrize(
    ("tree", "backend"),
    [(False, "hf"), (True, "hf"), (True, "native")],
    ids=["chain", "tree-hf", "tree-native"],
)
def test_greedy_equals_plain_and_learns_across_requests(target, tree, backend):
    prompt = '{"name": "search", "arguments": {"query": "weather in Paris"}} ' * 2
    plain = _plain(target, prompt, backend)  # the native backend may compute in lower precision
    store = SuffixStore(depth=24, max_nodes=100_000)
    if tree:  # a competing, wrong variant of the answer makes the drafter branch
        ids = plain.prompt_ids[-8:] + plain.token_ids
        store.add(ids[:14] + [(t + 1) % 300 for t in ids[14:20]] + ids[20:])
    drafter = SuffixDrafter(store, depth=24, tree=tree, eos_token_ids=target.eos_token_ids)
    engine = Engine(target=target, drafter=drafter, k=8, backend=backend)
    tree_calls = spy_trees(engine.backend)
    first = engine.generate(prompt, max_new_tokens=MAX_NEW, chat=False)
    second = engine.generate(prompt, max_new_tokens=MAX_NEW, chat=False)  # the store knows it now
    assert first.token_ids == plain.token_ids
    assert second.token_ids == plain.token_ids
    assert second.stats.num_accepted_tokens >= MAX_NEW // 2
    assert second.stats.num_steps < plain.stats.num_steps // 2
    assert bool(tree_calls) == tree
    assert all(len(tree) <= 8 + 1 for tree in tree_calls)  # k = 8 nodes below the pending token, as a chain


def test_greedy_equals_plain_from_the_request_alone(target):
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    plain = _plain(target, prompt)
    engine = Engine(target=target, drafter=SuffixDrafter(None, depth=24), k="auto")
    result = engine.generate(prompt, max_new_tokens=MAX_NEW, chat=False)
    assert result.token_ids == plain.token_ids
    assert result.stats.num_draft_tokens > 0


@pytest.mark.slow
def test_tree_drafting_on_the_embedded_model(smollm2):
    """A second identical request drafts from the first one's output, as a tree when the store
    holds two different answers; the output stays the plain greedy one."""
    prompt = 'Reply with a JSON tool call to get the weather in Oslo on 2025-03-08.'
    plain = Engine(target=smollm2, drafter="none", k=0).generate(prompt, max_new_tokens=24)
    store = SuffixStore(depth=24, max_nodes=100_000)
    ids = plain.prompt_ids[-8:] + plain.token_ids
    store.add(ids[:12] + [(t + 7) % 49152 for t in ids[12:]])  # a wrong answer to branch against
    drafter = SuffixDrafter(store, depth=24, tree=True, eos_token_ids=smollm2.eos_token_ids)
    engine = Engine(target=smollm2, drafter=drafter, k=8)
    first = engine.generate(prompt, max_new_tokens=24)
    second = engine.generate(prompt, max_new_tokens=24)
    assert first.token_ids == plain.token_ids and second.token_ids == plain.token_ids
    assert second.stats.num_accepted_tokens >= 12


def test_sampling_with_tree_drafts(target):
    """Sampling goes through tree verification too, reproducibly for a seed and a drafter state."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    plain = _plain(target, prompt)
    ids = plain.prompt_ids[-8:] + plain.token_ids

    def run():
        store = SuffixStore(depth=24, max_nodes=100_000)
        store.add(ids)
        store.add(ids[:12] + [(t + 1) % 300 for t in ids[12:]])  # a second answer to branch to
        drafter = SuffixDrafter(store, depth=24, tree=True, branch_prob=0.1,
                                eos_token_ids=target.eos_token_ids)
        engine = Engine(target=target, drafter=drafter, k=6)
        tree_calls = spy_trees(engine.backend)
        result = engine.generate(prompt, max_new_tokens=MAX_NEW, temperature=0.3, seed=3, chat=False)
        return result, tree_calls

    (first, tree_calls), (second, _) = run(), run()
    assert first.token_ids == second.token_ids
    assert tree_calls and first.stats.num_accepted_tokens > 0
