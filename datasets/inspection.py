"""``hpcllm inspect``: what a prepared folder holds, whether it is intact, and its text back.

A run folder is inspected by :mod:`hpcllm.train.inspect_run` instead.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from typing import Any, BinaryIO

from hpcllm.datasets.shards import SPLITS, Manifest, corrupt, open_shard, verify_shard
from hpcllm.datasets.tokenizer import EOS_TOKEN

DUMP_SEPARATOR = f"\n{EOS_TOKEN}\n"


def summary(manifest: Manifest) -> dict[str, Any]:
    """Return the manifest's totals and shard list as a JSON-ready dict."""
    tok = manifest.raw["tokenizer"]
    return {
        "path": str(manifest.root),
        "format_version": manifest.raw["format_version"],
        "tokenizer": {
            "kind": tok["kind"],
            "vocab_size": tok["vocab_size"],
            "eos_id": tok["eos_id"],
            "bos_id": tok.get("bos_id"),
            "sha256": tok["sha256"],
        },
        "token_dtype": manifest.raw["token_dtype"],
        "text_bytes": manifest.raw["text_bytes"],
        "splits": {
            split: {
                "shards": len(manifest.shards[split]),
                "documents": manifest.n_documents(split),
                "tokens": manifest.n_tokens(split),
                "text_bytes": sum(x.text_bytes for x in manifest.shards[split]),
                "files": [s.path.name for s in manifest.shards[split]],
            }
            for split in SPLITS
        },
        "prepare": manifest.raw.get("prepare", {}),
    }


def render_summary(info: dict[str, Any]) -> str:
    """Return :func:`summary` as a few readable lines."""
    tok = info["tokenizer"]
    lines = [
        f"{info['path']}  (format v{info['format_version']}, tokens {info['token_dtype']})",
        f"tokenizer  {tok['kind']}, vocab {tok['vocab_size']}, eos id {tok['eos_id']}, "
        + ("" if tok["bos_id"] is None else f"bos id {tok['bos_id']}, ")
        + f"sha256 {tok['sha256'][:12]}",
        f"text       {info['text_bytes'] / 1e6:.2f} MB",
    ]
    for split, s in info["splits"].items():
        ratio = f", {s['text_bytes'] / max(1, s['tokens']):.2f} B/token"
        lines.append(
            f"{split:<10} {s['shards']} shards, {s['documents']} documents, "
            f"{s['tokens']} tokens{ratio}"
        )
    prep = info["prepare"]
    if prep:
        lines.append(
            f"prepared   on {prep['ranks']} ranks in {prep['seconds']:.1f} s "
            f"({prep['mb_per_s']:.2f} MB/s of text); setup and tokenizer "
            f"{prep['setup_seconds']:.1f} s, then tokenize + write "
            f"{prep['tokenize_seconds']:.1f} s ({prep['tokenize_mb_per_s']:.2f} MB/s)"
        )
    return "\n".join(lines)


def verify(manifest: Manifest) -> int:
    """Check every shard's checksums and counts; return how many were checked, else raise."""
    count = 0
    for split in SPLITS:
        for shard in manifest.shards[split]:
            verify_shard(manifest, shard)
            count += 1
    return count


def _documents(manifest: Manifest, split: str) -> Iterator[tuple[int, Any]]:
    """Yield ``(doc_id, token ids without EOS)`` of a split, in document order."""

    def one_shard(shard: Any) -> Iterator[tuple[int, Any]]:
        handle = open_shard(manifest, shard)
        try:
            try:
                offsets = handle["doc_offsets"][:]
                doc_ids = handle["doc_ids"][:]
                tokens = handle["tokens"][:]
            except OSError as err:
                raise corrupt(shard.path, "shard data", err) from None
            for i, doc_id in enumerate(doc_ids):
                yield int(doc_id), tokens[offsets[i] : offsets[i + 1] - 1]
        finally:
            handle.close()

    # Each shard holds its documents in increasing id; merging restores corpus order.
    yield from heapq.merge(
        *(one_shard(s) for s in manifest.shards[split]), key=lambda item: item[0]
    )


def dump(manifest: Manifest, split: str, out: BinaryIO) -> int:
    """Write every document of ``split``, decoded, each followed by the separator; return count.

    Documents come out in corpus order, byte for byte as they went in.
    """
    tokenizer = manifest.load_tokenizer()
    count = 0
    for _, ids in _documents(manifest, split):
        out.write(tokenizer.decode_document(ids.tolist()).encode("utf-8"))
        out.write(DUMP_SEPARATOR.encode("utf-8"))
        count += 1
    out.flush()
    return count
