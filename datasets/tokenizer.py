"""Tokenizers for prepare and the reader: raw bytes, a BPE trained here, or a given Hugging Face
tokenizer (a tokenizer.json, or a folder with tokenizer.json and tokenizer_config.json).

All are lossless on UTF-8 text when byte-level (a tokenizer.json with a normaliser is not, and
prepare warns), so decoding a shard gives back the text that went in. Each has an end-of-text
id (EOS) that ends every packed document, and may have a beginning-of-text id (BOS) that starts
each: Llama 3's ``<|begin_of_text|>``, Mistral's ``<s>``.

A Hugging Face folder's tokenizer_config.json names them (``bos_token``, ``eos_token``).
Without one, EOS is the first of :data:`KNOWN_EOS` the tokenizer has. BOS starts documents
when tokenizer_config.json says ``add_bos_token: true``, or, where it says nothing, when the
tokenizer's own post-processor adds it (Llama 3's does, GPT-2's does not); never when BOS is
EOS (GPT-2 names ``<|endoftext|>`` for both).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from hpcllm.errors import UserError
from hpcllm.files import atomic_write

EOS_TOKEN = "<|endoftext|>"
# End-of-text tokens looked for when no tokenizer_config.json names one: GPT-2's, Llama 3's,
# Llama 2's and Mistral's.
KNOWN_EOS = (EOS_TOKEN, "<|end_of_text|>", "</s>")
BYTE_VOCAB = 257  # 256 byte values, then EOS
TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
BESIDE = "beside"  # load_tokenizer: read the tokenizer_config.json beside the file, if any


def _token_name(value: Any, key: str, where: str) -> str | None:
    """Return a special token's text from tokenizer_config.json: a string, or an added-token
    object's ``content``; None where unset."""
    if value is None:
        return None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    if isinstance(value, str):
        return value
    raise UserError(f"{where}: {key} is {value!r}, not a token (a string or {{'content': ...}})")


class Tokenizer:
    """A text ↔ ids codec with an EOS id and maybe a BOS id.

    ``spec`` is the tokenizer.json text that saves and restores it; ``config`` the text of its
    tokenizer_config.json (None: none).
    """

    def __init__(
        self,
        spec: str,
        config: str | None = None,
        where: str = "the tokenizer",
        config_where: str | None = None,
    ) -> None:
        self.spec, self.config = spec, config
        parsed = json.loads(spec)
        self.kind = "byte" if parsed.get("hpcllm_byte_tokenizer") else "hf"
        self.bos_id: int | None = None
        self.bos_token: str | None = None
        if self.kind == "byte":
            self._hf = None
            self.vocab_size = BYTE_VOCAB
            self.eos_id, self.eos_token = BYTE_VOCAB - 1, EOS_TOKEN
            return
        from tokenizers import Tokenizer as HFTokenizer

        self._hf = HFTokenizer.from_str(spec)
        self.vocab_size = self._hf.get_vocab_size(with_added_tokens=True)
        config_where = config_where or f"{where}'s {CONFIG_FILE}"
        settings = self._settings(config_where)
        eos = _token_name(settings.get("eos_token"), "eos_token", config_where)
        if eos is not None and self._hf.token_to_id(eos) is None:
            raise UserError(f"{config_where} names eos_token {eos!r}, which the tokenizer lacks")
        eos = eos or next((t for t in KNOWN_EOS if self._hf.token_to_id(t) is not None), None)
        if eos is None:
            raise UserError(
                f"{where} has no end-of-text token to end documents with ({', '.join(KNOWN_EOS)} "
                f"are looked for); name it as eos_token in a {CONFIG_FILE} beside "
                f"{TOKENIZER_FILE}, or add {EOS_TOKEN} as a special token"
            )
        self.eos_token, self.eos_id = eos, self._hf.token_to_id(eos)
        bos = _token_name(settings.get("bos_token"), "bos_token", config_where)
        if bos is not None and bos != eos:
            bos_id = self._hf.token_to_id(bos)
            if bos_id is None:
                raise UserError(
                    f"{config_where} names bos_token {bos!r}, which the tokenizer lacks"
                )
            adds = settings.get("add_bos_token")
            if adds is None:  # the tokenizer's post-processor decides, as in transformers
                adds = self._hf.encode("a", add_special_tokens=True).ids[:1] == [bos_id]
            if adds:
                self.bos_id, self.bos_token = bos_id, bos
        # A special token written in a document is text, not the end of the document.
        self._hf.encode_special_tokens = True

    def _settings(self, where: str) -> dict[str, Any]:
        if self.config is None:
            return {}
        try:
            settings = json.loads(self.config)
        except json.JSONDecodeError as err:
            raise UserError(f"{where} is not valid JSON: {err}") from None
        if not isinstance(settings, dict):
            raise UserError(f"{where} is not a JSON object")
        return settings

    @property
    def sha256(self) -> str:
        """Return the hash that shards and the manifest record to tie data to this tokenizer."""
        return hashlib.sha256(self.spec.encode()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Return the ids of each text (no BOS, no EOS)."""
        if self._hf is None:
            return [list(text.encode("utf-8")) for text in texts]
        return [enc.ids for enc in self._hf.encode_batch(texts, add_special_tokens=False)]

    def with_bos(self, ids: list[int]) -> list[int]:
        """Return ``ids`` as a document starts: after BOS, where this tokenizer has one."""
        return ids if self.bos_id is None else [self.bos_id, *ids]

    def decode(self, ids: Iterable[int]) -> str:
        """Return the text of ``ids`` (which must not contain EOS)."""
        if self._hf is None:
            return bytes(ids).decode("utf-8")
        return self._hf.decode(list(ids), skip_special_tokens=False)

    def decode_document(self, ids: Iterable[int]) -> str:
        """Return the text of a document's ids (without EOS): its BOS, if any, dropped."""
        ids = list(ids)
        if self.bos_id is not None and ids[:1] == [self.bos_id]:
            ids = ids[1:]
        return self.decode(ids)

    def save(self, path: Path) -> None:
        """Write tokenizer.json to ``path`` and its tokenizer_config.json beside it (or remove
        one there), each atomically."""
        atomic_write(path, self.spec)
        beside = Path(path).parent / CONFIG_FILE
        if self.config is not None:
            atomic_write(beside, self.config)
        else:
            beside.unlink(missing_ok=True)

    def hf_config(self, model_max_length: int) -> str:
        """Return the tokenizer_config.json to ship with a Hugging Face export: this one's, or
        one that names its special tokens for transformers' fast tokenizer."""
        if self.config is not None:
            return self.config
        settings = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": self.bos_token or self.eos_token,
            "eos_token": self.eos_token,
            "add_bos_token": self.bos_id is not None,
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": False,
        }
        return json.dumps(settings, indent=2) + "\n"


def byte_tokenizer() -> Tokenizer:
    """Return the raw-byte tokenizer: ids 0–255 are bytes, 256 is EOS."""
    return Tokenizer(json.dumps({"hpcllm_byte_tokenizer": 1, "eos": EOS_TOKEN}))


def load_tokenizer(path: Path, config: Path | str | None = BESIDE) -> Tokenizer:
    """Return the tokenizer at ``path``: ours, a Hugging Face tokenizer.json, or a Hugging Face
    tokenizer folder (tokenizer.json with, optionally, tokenizer_config.json).

    ``config``: the tokenizer_config.json to read; :data:`BESIDE` (the default) reads the one
    beside a file named tokenizer.json, if there is one; None reads none.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / TOKENIZER_FILE).is_file():
            raise UserError(
                f"tokenizer folder {path} has no {TOKENIZER_FILE} (a Hugging Face tokenizer "
                f"folder has {TOKENIZER_FILE} and {CONFIG_FILE}; a SentencePiece "
                "tokenizer.model alone is not read)"
            )
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise UserError(f"tokenizer file {path} does not exist")
    if config == BESIDE:  # a Hugging Face folder's layout: tokenizer.json beside its config
        config = path.parent / CONFIG_FILE
        config = config if path.name == TOKENIZER_FILE and config.is_file() else None
    try:
        config_text = Path(config).read_text() if config is not None else None
        return Tokenizer(path.read_text(), config_text, str(path), config and str(config))
    except UserError:
        raise
    except OSError as err:
        raise UserError(f"reading the tokenizer {path} failed: {err}") from None
    except Exception as err:  # tokenizers raises a bare Exception on bad JSON
        raise UserError(f"{path} is not a tokenizer.json: {err}") from None


def copy_tokenizer(source: Path, folder: Path) -> None:
    """Copy a tokenizer (a tokenizer.json, or a folder) into ``folder`` as tokenizer.json and,
    if it has one, tokenizer_config.json (else removing one there)."""
    load_tokenizer(source).save(Path(folder) / TOKENIZER_FILE)


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
