"""`specdec datastore build FILES... --out DIR`: index a corpus for `--drafter retrieval:DIR`."""

from __future__ import annotations

import argparse
import time

from specdec.cli_args import add_model_args
from specdec.drafters.datastore import build_from_texts, read_corpus
from specdec.models import load_tokenizer


def add_parser(sub) -> None:
    p = sub.add_parser("datastore", help="build a retrieval datastore for the `retrieval:DIR` drafter")
    actions = p.add_subparsers(dest="datastore_command", required=True, parser_class=type(p))
    build = actions.add_parser("build", help="tokenize files with the target's tokenizer and index them")
    build.add_argument("files", nargs="+",
                       help="text files, .jsonl files (one document a line) or directories")
    build.add_argument("--out", required=True, help="directory to write the datastore into")
    add_model_args(build)
    build.set_defaults(func=run_build)


def run_build(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    texts, num_files = read_corpus(args.files)  # bad paths fail before the tokenizer loads
    tokenizer = load_tokenizer(args.target)
    info = build_from_texts(texts, args.out, tokenizer, {"target": args.target, "files": num_files})
    print(
        f"datastore {args.out}: {info['num_tokens']} tokens from {info['num_docs']} documents "
        f"({num_files} files) in {time.perf_counter() - start:.1f}s; "
        f"use it with --drafter retrieval:{args.out}"
    )
