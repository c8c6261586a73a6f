"""The retrieval datastore: a tokenized corpus and a suffix array over it, as .npy files.

Layout of a datastore directory:
- `tokens.npy`: int32 [N], every document's token ids, each document followed by SEP (-1);
  SEP padding before the first document and after the last keeps every read in bounds.
- `ends.npy`: int64 [M], the positions of the non-SEP tokens, sorted by the *reversed*
  string that ends there (tokens[e], tokens[e-1], ...). This is the suffix array of the
  reversed corpus, so the entries whose strings end with a pattern form one contiguous
  range, and the longest suffix of a context is found by narrowing that range one token at
  a time, walking the context backwards. A match ending at e continues at e + 1.
- `datastore.json`: format version, the tokenizer's fingerprint, sizes and sources.

Arrays load with `allow_pickle=False` and are memory-mapped, so a large store costs no RAM
up front.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdec.errors import SpecdecError

FORMAT = "specdec-datastore"
VERSION = 1
SEP = -1
MAX_MATCH = 64  # longest context suffix a lookup may match; also how far the sort looks
MAX_READ = 64  # longest continuation a lookup may read


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the token -> id mapping: a store is usable exactly when ids mean the same."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:32]


def reversed_suffix_order(tokens: np.ndarray, max_len: int) -> np.ndarray:
    """Positions e with tokens[e] != SEP, sorted by (tokens[e], tokens[e-1], ...), compared on
    at most `max_len` tokens (prefix doubling: O(N log N) per round, log2(max_len) rounds)."""
    rev = tokens[::-1].astype(np.int64)  # [N] suffix i of rev is the reversed string ending at N-1-i
    n = rev.shape[0]
    _, rank = np.unique(rev, return_inverse=True)  # dense ranks; SEP (-1) gets rank 0
    rank = rank.astype(np.int64) + 1  # 0 is kept for "past the end"
    h = 1
    while h < max_len:
        nxt = np.zeros(n, dtype=np.int64)
        nxt[: n - h] = rank[h:]
        key = rank * (n + 2) + nxt
        _, rank = np.unique(key, return_inverse=True)
        rank = rank.astype(np.int64) + 1
        if rank.max() == n:  # every suffix already has a distinct rank
            break
        h *= 2
    order = np.argsort(rank, kind="stable")  # [N] positions in rev
    order = order[rev[order] != SEP]
    return (n - 1 - order).astype(np.int64)  # positions in tokens


def build(docs: list[list[int]], out: str | Path, fingerprint: str, meta: dict | None = None) -> dict:
    """Write a datastore for tokenized documents into `out`; return its metadata."""
    docs = [d for d in docs if d]
    if not docs:
        raise SpecdecError("the corpus has no text to index", "files")
    total = sum(len(d) + 1 for d in docs)
    tokens = np.full(MAX_MATCH + 1 + total + MAX_READ, SEP, dtype=np.int32)
    pos = MAX_MATCH + 1
    for doc in docs:
        tokens[pos : pos + len(doc)] = doc
        pos += len(doc) + 1
    ends = reversed_suffix_order(tokens, MAX_MATCH)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "tokens.npy", tokens, allow_pickle=False)
    np.save(out / "ends.npy", ends, allow_pickle=False)
    info = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer_fingerprint": fingerprint,
        "num_docs": len(docs),
        "num_tokens": int(ends.shape[0]),
        "max_match": MAX_MATCH,
        "max_read": MAX_READ,
        **(meta or {}),
    }
    (out / "datastore.json").write_text(json.dumps(info, indent=2))
    return info


@dataclass
class Match:
    lo: int  # the matching entries are ends[lo:hi]
    hi: int
    length: int  # tokens of the context matched


class Datastore:
    """A loaded datastore; read-only, so one instance serves every request of a process."""

    def __init__(self, directory: str | Path, fingerprint: str | None = None):
        directory = Path(directory)
        meta_path = directory / "datastore.json"
        if not meta_path.is_file():
            raise SpecdecError(
                f"no datastore at {str(directory)!r}; build one with "
                f"`specdec datastore build FILES... --out {directory}`",
                "drafter",
            )
        try:
            self.meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise SpecdecError(f"unreadable datastore metadata {str(meta_path)!r}: {e}", "drafter") from e
        if self.meta.get("format") != FORMAT or self.meta.get("version") != VERSION:
            raise SpecdecError(
                f"{str(directory)!r} is not a version-{VERSION} specdec datastore; rebuild it", "drafter"
            )
        if fingerprint is not None and self.meta.get("tokenizer_fingerprint") != fingerprint:
            raise SpecdecError(
                f"datastore {str(directory)!r} was built with another tokenizer "
                f"({self.meta.get('target', 'unknown target')}); rebuild it with this target's tokenizer",
                "drafter",
            )
        try:
            # Plain ndarray views of the mappings: np.memmap's own indexing is several times slower.
            self.tokens = np.load(directory / "tokens.npy", mmap_mode="r",
                                  allow_pickle=False).view(np.ndarray)
            self.ends = np.load(directory / "ends.npy", mmap_mode="r", allow_pickle=False).view(np.ndarray)
        except (OSError, ValueError) as e:
            raise SpecdecError(f"datastore {str(directory)!r} is damaged: {e}", "drafter") from e
        if self.tokens.ndim != 1 or self.ends.ndim != 1 or self.tokens.dtype != np.int32:
            raise SpecdecError(f"datastore {str(directory)!r} is damaged: unexpected array shapes", "drafter")
        self.max_match = int(self.meta["max_match"])
        self.max_read = int(self.meta["max_read"])
        # Entries are sorted by their last token first: a table of where each token's range
        # starts makes the first narrowing step O(1).
        last = np.asarray(self.tokens[self.ends])  # [M] non-decreasing
        self._first_token = np.unique(last)  # [U] sorted distinct last tokens
        self._first_start = np.searchsorted(last, self._first_token, side="left")  # [U]
        self._first_end = np.searchsorted(last, self._first_token, side="right")  # [U]

    def __len__(self) -> int:
        return int(self.ends.shape[0])

    def _narrow(self, lo: int, hi: int, offset: int, token: int) -> tuple[int, int]:
        """Within ends[lo:hi] (sorted by tokens[e - offset]) the sub-range equal to `token`."""
        if hi - lo <= 64:  # small: gather the column once
            column = self.tokens[self.ends[lo:hi] - offset]
            return (lo + int(np.searchsorted(column, token, "left")),
                    lo + int(np.searchsorted(column, token, "right")))
        tokens, ends = self.tokens, self.ends

        def key(i: int) -> int:
            return int(tokens[ends[i] - offset])

        left = bisect.bisect_left(range(hi), token, lo, hi, key=key)
        right = bisect.bisect_right(range(hi), token, left, hi, key=key)
        return left, right

    def longest_match(self, context: list[int], max_len: int | None = None) -> Match:
        """The longest suffix of `context` (at most max_len tokens) found in the corpus."""
        max_len = min(max_len or self.max_match, self.max_match, len(context))
        if max_len <= 0:
            return Match(0, 0, 0)
        last = context[-1]
        i = int(np.searchsorted(self._first_token, last))
        if i == len(self._first_token) or int(self._first_token[i]) != last:
            return Match(0, 0, 0)
        match = Match(int(self._first_start[i]), int(self._first_end[i]), 1)
        for offset in range(1, max_len):
            if (match.hi - match.lo) * (max_len - offset) <= 16384:
                return self._match_block(match, context, max_len)
            lo, hi = self._narrow(match.lo, match.hi, offset, context[-1 - offset])
            if lo == hi:
                break
            match = Match(lo, hi, offset + 1)
        return match

    def _match_block(self, match: Match, context: list[int], max_len: int) -> Match:
        """Finish a match whose range is small in one vectorized comparison."""
        offsets = np.arange(match.length, max_len)  # [L]
        pattern = np.asarray(context[-1 - match.length : -1 - max_len : -1] if max_len < len(context)
                             else context[-1 - match.length :: -1])  # [L] the context read backwards
        block = self.tokens[self.ends[match.lo : match.hi, None] - offsets]  # [R, L]
        matched = np.cumprod(block == pattern, axis=1).sum(axis=1)  # [R] further tokens matched
        best = int(matched.max())
        rows = np.flatnonzero(matched == best)  # contiguous, since the rows are sorted
        return Match(match.lo + int(rows[0]), match.lo + int(rows[-1]) + 1, match.length + best)

    def continuations(self, match: Match, max_rows: int, length: int) -> list[list[int]]:
        """Up to `max_rows` continuations (spread evenly over the match) of up to `length`
        tokens each, cut at the end of their document."""
        count = match.hi - match.lo
        if count <= 0:
            return []
        length = min(length, self.max_read)
        if count > max_rows:
            picks = match.lo + (np.arange(max_rows) * count) // max_rows
        else:
            picks = np.arange(match.lo, match.hi)
        starts = np.asarray(self.ends[picks]) + 1  # [R]
        rows = np.asarray(self.tokens[starts[:, None] + np.arange(length)])  # [R, length]
        out = []
        for row in rows.tolist():
            if SEP in row:
                row = row[: row.index(SEP)]
            if row:
                out.append(row)
        return out


def read_corpus(paths: list[str]) -> tuple[list[str], int]:
    """Documents from files and directories (recursively): one per text file, one per line
    of a .jsonl file (its "text", or the contents of its "messages"). Returns (docs, files)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_dir():
            found = (p for p in path.rglob("*") if p.is_file())
            files.extend(sorted(p for p in found
                                if not any(s.startswith(".") for s in p.relative_to(path).parts)))
        elif path.is_file():
            files.append(path)
        else:
            raise SpecdecError(f"no such file or directory: {raw!r}", "files")
    docs: list[str] = []
    for path in files:
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # a binary file: nothing to learn from
            continue
        text = data.decode("utf-8", errors="replace")
        if path.suffix == ".jsonl":
            docs.extend(_jsonl_docs(text, path))
        elif text.strip():
            docs.append(text)
    return docs, len(files)


def _jsonl_docs(text: str, path: Path) -> list[str]:
    docs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as e:
            raise SpecdecError(f"{path}:{number}: not JSON ({e})", "files") from e
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            docs.append(record["text"])
        elif isinstance(record, dict) and isinstance(record.get("messages"), list):
            docs.append("\n".join(str(m.get("content", "")) for m in record["messages"]
                                  if isinstance(m, dict)))
        elif isinstance(record, str):
            docs.append(record)
        else:
            docs.append(line)
    return docs


def build_from_texts(texts: list[str], out: str, tokenizer, meta: dict) -> dict:
    """Tokenize documents (no special tokens, as they appear inside a context) and build."""
    docs: list[list[int]] = []
    for i in range(0, len(texts), 256):
        docs.extend(tokenizer(texts[i : i + 256], add_special_tokens=False)["input_ids"])
    return build(docs, out, tokenizer_fingerprint(tokenizer), meta)
