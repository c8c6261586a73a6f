"""The retrieval datastore (suffix array over a tokenized corpus) and the `retrieval` drafter."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from conftest import save_loaded, tiny_llama
from specdec import Engine, SpecdecError
from specdec.cli import main
from specdec.drafters import make_drafter
from specdec.drafters.datastore import Datastore, build, read_corpus, tokenizer_fingerprint
from specdec.drafters.retrieval import RetrievalDrafter
from specdec.tree import first_path


def _brute_match(docs, context, max_len):
    for length in range(min(max_len, len(context)), 0, -1):
        pattern = context[-length:]
        found = [
            doc[i + length :]
            for doc in docs
            for i in range(len(doc) - length + 1)
            if doc[i : i + length] == pattern
        ]
        if found:
            return length, found
    return 0, []


@pytest.mark.parametrize("seed", range(6))
def test_longest_match_and_continuations_equal_brute_force(tmp_path, seed):
    rng = random.Random(seed)
    docs = [[rng.randrange(4) for _ in range(rng.randrange(1, 40))] for _ in range(rng.randrange(1, 6))]
    build(docs, tmp_path, "fp")
    store = Datastore(tmp_path, "fp")
    for _ in range(30):
        context = [rng.randrange(4) for _ in range(rng.randrange(1, 12))]
        length, found = _brute_match(docs, context, 10)
        match = store.longest_match(context, 10)
        assert match.length == length and match.hi - match.lo == len(found)
        rows = store.continuations(match, max_rows=1000, length=5)
        assert sorted(rows) == sorted(f[:5] for f in found if f)  # cut at each document's end


def _store(tmp_path, docs, fingerprint="fp"):
    build(docs, tmp_path, fingerprint)
    return Datastore(tmp_path, fingerprint)


@pytest.mark.parametrize(
    ("context", "options", "expected"),
    [
        # "= foo (" was followed by "1 )" twice and by "2 )" once; after "1 )" one of the two
        # rows ends with its document, so "\n" has probability 2/3 * 1/2 < min_prob.
        ([9, 5, 6, 7], {"min_prob": 0.5}, [1, 8]),
        # The longest match decides: "x = foo (" only ever went on with "2", up to EOS.
        ([4, 5, 6, 7], {}, [2, 8, 3, 99]),
        # 2/3 then 1: with min_prob 0.7 the first token is already too uncertain.
        ([9, 5, 6, 7], {"min_prob": 0.7}, []),
        ([42], {}, []),  # never seen
        ([6, 7], {"k": 1}, [1]),  # at most k tokens
    ],
)
def test_proposals(tmp_path, context, options, expected):
    # Tokens: 4 "x", 5 "=", 6 "foo", 7 "(", 1/2 args, 8 ")", 3 "\n", 99 EOS.
    docs = [[3, 5, 6, 7, 1, 8, 3, 5, 6, 7, 1, 8], [4, 5, 6, 7, 2, 8, 3, 99, 0]]
    k = options.pop("k", 8)
    drafter = RetrievalDrafter(_store(tmp_path, docs), eos_token_ids={99}, **options)
    assert drafter.propose(context, k).tokens == expected


def test_tree_holds_the_competing_continuations(tmp_path):
    docs = [[5, 6, 7, 1, 8], [5, 6, 7, 1, 8], [5, 6, 7, 2, 8]]
    drafter = RetrievalDrafter(_store(tmp_path, docs), tree=True, max_nodes=8)
    draft = drafter.propose([0, 6, 7], 3)
    assert draft.parents is not None
    assert [t for t, p in zip(draft.tokens, draft.parents, strict=True) if p == -1] == [1, 2]
    assert [draft.tokens[i] for i in first_path(draft.parents)] == [1, 8]


def test_stops_at_eos(tmp_path):
    drafter = RetrievalDrafter(_store(tmp_path, [[1, 2, 99, 3, 4]]), eos_token_ids={99})
    assert drafter.propose([1], 8).tokens == [2, 99]


def test_cli_build_and_load(tmp_path, capsys):
    target = tiny_llama(seed=0)
    model_dir = save_loaded(target, tmp_path / "model")
    (tmp_path / "notes.txt").write_text("def add(a, b):\n    return a + b\n")
    (tmp_path / "log.jsonl").write_text(
        json.dumps({"text": "The quick brown fox"}) + "\n"
        + json.dumps({"messages": [{"role": "user", "content": "weather in Paris"}]}) + "\n"
    )
    out = tmp_path / "store"
    main(["datastore", "build", str(tmp_path / "notes.txt"), str(tmp_path / "log.jsonl"),
          "--out", str(out), "--target", model_dir])
    assert "3 documents" in capsys.readouterr().out
    for name in ("tokens.npy", "ends.npy"):
        np.load(out / name, allow_pickle=False)  # plain arrays, no pickle
    drafter = make_drafter(f"retrieval:{out}:tree=1:rows=16", target)
    ids = target.tokenizer.encode("def add(a, b):\n    return", add_special_tokens=False)
    expected = target.tokenizer.encode(" a + b", add_special_tokens=False)
    assert drafter.propose(ids, len(expected)).tokens[: len(expected)] == expected


def test_cli_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["datastore", "build", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "s")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "no such file" in err and err.count("\n") == 1


def test_refuses_another_tokenizer_and_bad_stores(tmp_path):
    target = tiny_llama(seed=0)
    build([[1, 2, 3]], tmp_path / "other", "0" * 32, {"target": "some-other-model"})
    with pytest.raises(SpecdecError, match="another tokenizer.*some-other-model"):
        make_drafter(f"retrieval:{tmp_path / 'other'}", target)
    with pytest.raises(SpecdecError, match="no datastore"):
        make_drafter(f"retrieval:{tmp_path / 'nowhere'}", target)
    with pytest.raises(SpecdecError, match="needs a datastore"):
        make_drafter("retrieval", target)
    build([[1, 2, 3]], tmp_path / "ok", tokenizer_fingerprint(target.tokenizer))
    with pytest.raises(SpecdecError, match="bad retrieval options"):
        make_drafter(f"retrieval:{tmp_path / 'ok'}:rows=0", target)
    with pytest.raises(SpecdecError, match="no text"):
        build([[]], tmp_path / "empty", "fp")


def test_read_corpus_walks_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "one.md").write_text("# one")
    (tmp_path / "a" / "blob.bin").write_bytes(b"\0\1\2")
    (tmp_path / "a" / ".hidden").write_text("secret")
    docs, files = read_corpus([str(tmp_path / "a")])
    assert docs == ["# one"] and files == 2


# ---- greedy losslessness end to end -------------------------------------------------------

MAX_NEW = 40


@pytest.mark.parametrize(
    ("tree", "backend"),
    [(False, "hf"), (True, "hf"), (True, "native")],
    ids=["chain", "tree-hf", "tree-native"],
)
def test_greedy_equals_plain(tmp_path, tree, backend):
    from conftest import spy_trees

    target = tiny_llama(seed=0)
    prompt = "| name | value |\n|------|-------|\n| a | 1 |\n"
    plain_engine = Engine(target=target, drafter="none", k=0, backend=backend)  # same backend, same numerics
    plain = plain_engine.generate(prompt, max_new_tokens=MAX_NEW, chat=False)
    ids = plain.prompt_ids[-6:] + plain.token_ids
    corpus = [ids, ids[:16] + [(t + 1) % 300 for t in ids[16:]]]  # the answer, and a wrong variant
    drafter = RetrievalDrafter(_store(tmp_path, corpus, "fp"), tree=tree, max_nodes=16)
    engine = Engine(target=target, drafter=drafter, k=8, backend=backend)
    tree_calls = spy_trees(engine.backend)
    result = engine.generate(prompt, max_new_tokens=MAX_NEW, chat=False)
    assert result.token_ids == plain.token_ids
    assert result.stats.num_accepted_tokens >= MAX_NEW // 2
    assert bool(tree_calls) == tree
