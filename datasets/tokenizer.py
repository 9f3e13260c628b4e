"""Tokenizers for prepare and the reader: raw bytes, a BPE trained here, or a given tokenizer.json.

All three are lossless on UTF-8 text (byte-level), so decoding a shard gives back the text that
went in, byte for byte. Each has an end-of-text id that separates packed documents.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from hpcllm.errors import UserError
from hpcllm.files import atomic_write

EOS_TOKEN = "<|endoftext|>"
BYTE_VOCAB = 257  # 256 byte values, then EOS


class Tokenizer:
    """A text ↔ ids codec with an EOS id; ``spec`` is the JSON that saves and restores it."""

    def __init__(self, spec: str) -> None:
        self.spec = spec
        parsed = json.loads(spec)
        self.kind = "byte" if parsed.get("hpcllm_byte_tokenizer") else "hf"
        if self.kind == "byte":
            self._hf = None
            self.vocab_size = BYTE_VOCAB
            self.eos_id = BYTE_VOCAB - 1
        else:
            from tokenizers import Tokenizer as HFTokenizer

            self._hf = HFTokenizer.from_str(spec)
            # "<|endoftext|>" written in a document is text, not the end of the document.
            self._hf.encode_special_tokens = True
            self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
            eos = self._hf.token_to_id(EOS_TOKEN)
            if eos is None:
                raise UserError(
                    f"the tokenizer has no {EOS_TOKEN} token to end documents with; "
                    f"add it as a special token"
                )
            self.eos_id = eos

    @property
    def sha256(self) -> str:
        """Return the hash that shards and the manifest record to tie data to this tokenizer."""
        return hashlib.sha256(self.spec.encode()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Return the ids of each text (no EOS appended)."""
        if self._hf is None:
            return [list(text.encode("utf-8")) for text in texts]
        return [enc.ids for enc in self._hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of ``ids`` (which must not contain EOS)."""
        if self._hf is None:
            return bytes(ids).decode("utf-8")
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def save(self, path: Path) -> None:
        """Write the tokenizer's JSON to ``path`` atomically."""
        atomic_write(path, self.spec)


def byte_tokenizer() -> Tokenizer:
    """Return the raw-byte tokenizer: ids 0–255 are bytes, 256 is EOS."""
    return Tokenizer(json.dumps({"hpcllm_byte_tokenizer": 1, "eos": EOS_TOKEN}))


def load_tokenizer(path: Path) -> Tokenizer:
    """Return the tokenizer saved at ``path`` (ours, or any Hugging Face tokenizer.json)."""
    if not path.is_file():
        raise UserError(f"tokenizer file {path} does not exist")
    try:
        return Tokenizer(path.read_text())
    except UserError:
        raise
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise UserError(f"{path} is not a tokenizer.json: {err}") from None


def train_bpe(texts: Iterator[str], vocab_size: int) -> Tokenizer:
    """Return a byte-level BPE with ``vocab_size`` ids trained on ``texts`` (EOS included)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise UserError(f"--vocab-size must be at least 257 (256 bytes + EOS), got {vocab_size}")
    hf = HFTokenizer(models.BPE())
    # No normaliser and no prefix space: byte-level BPE then decodes to exactly the input.
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(texts, trainer=trainer)
    return Tokenizer(hf.to_str())
