"""``meshyard data prepare``: argument parsing and one line of report; the work is in ``prepare``."""

from __future__ import annotations

import argparse
from pathlib import Path

from meshyard.data.cache import DataSourceError
from meshyard.data.prepare import DEFAULT_SHARD_TOKENS, prepare_shards
from meshyard.storage_options import options_from_pairs


def _storage_options(pairs: list[str]) -> dict[str, object]:
    try:
        return options_from_pairs(pairs)
    except ValueError as exc:
        raise DataSourceError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction) -> None:
    """Register ``meshyard data prepare``; unreadable text or storage is told as ``meshyard data: ...``."""
    p = subparsers.add_parser("data", help="prepare corpora as token shards",
                              description="Work with training corpora.")
    sub = p.add_subparsers(dest="data_command", required=True, metavar="{prepare}")
    prep = sub.add_parser("prepare", help="tokenize text into shards with an index, locally or on object storage",
                          description="Tokenize text files (.txt: one document each; .jsonl: one per record) and "
                          "write them to --out (a folder or an fsspec URL: s3://, gs://) as shards of a fixed number "
                          "of tokens, an index.json with counts and SHA-256 digests, and the tokenizer beside them. "
                          "A rerun leaves shards already there untouched. Train on them with data.source = 'shards' "
                          "and data.url = the same URL.")
    prep.add_argument("source", nargs="+", metavar="SOURCE", help="text files or glob patterns")
    prep.add_argument("--out", required=True, metavar="URL", help="folder or fsspec URL to write the shards to")
    prep.add_argument("--tokenizer", default="bytes",
                      help="'bytes', 'bpe:N' (trained once on the text) or a Hugging Face tokenizer file or folder "
                      "(as data.tokenizer; default bytes)")
    prep.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                      help=f"tokens per shard (default {DEFAULT_SHARD_TOKENS})")
    prep.add_argument("--text-field", default="text", help="the field of each .jsonl record holding its text")
    prep.add_argument("--cache-dir", type=Path, default=None,
                      help="where tokenized text is cached on this machine (default ~/.cache/meshyard)")
    prep.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                      help="fsspec option for --out (repeatable), e.g. endpoint_url=http://127.0.0.1:9000")
    # An OSError names the file or URL it could not reach.
    p.set_defaults(handler=main, takes_overrides=False, own_errors=(DataSourceError, OSError),
                   error_prefix="meshyard data")


def main(args: argparse.Namespace, overrides: list[str]) -> int:
    """Run ``meshyard data prepare``."""
    if args.shard_tokens < 1:
        raise DataSourceError(f"--shard-tokens {args.shard_tokens} must be at least 1; give e.g. --shard-tokens "
                              f"{DEFAULT_SHARD_TOKENS}")
    prepare_shards(args.source, args.out, args.tokenizer, args.shard_tokens, args.text_field,
                   _storage_options(args.storage_option), args.cache_dir)
    return 0
