"""Tokenizers of the data step: OpenAI's GPT-2 BPE (tiktoken) and a character-level vocabulary.

Both expose ``name``, ``vocab_size``, ``encode(text) -> list[int]``, ``encode_prompt``,
``encode_array(text) -> np.ndarray`` (int64) and ``decode(ids) -> str``.
"""

from __future__ import annotations

import functools
import hashlib
import os
from collections.abc import Iterable, Sequence

import numpy as np
import tiktoken

TOKENIZERS = ("gpt2", "char")
GPT2_VOCAB_SIZE = 50257
MAX_VOCAB = 2**16  # ids fit uint16 token files


def _as_int_list(ids: Iterable[int]) -> list[int]:
    """Token ids as list / tuple / 1-D numpy array / 1-D torch tensor -> list of Python ints."""
    return [int(i) for i in (ids.tolist() if hasattr(ids, "tolist") else ids)]


@functools.lru_cache(maxsize=1)
def _gpt2_encoding():
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # tiktoken raises requests/urllib/OSError variants when offline
        cache = os.environ.get("TIKTOKEN_CACHE_DIR", "<unset>")
        raise RuntimeError(
            f"could not load tiktoken's GPT-2 BPE files ({type(e).__name__}: {e}). Without network access, "
            "set TIKTOKEN_CACHE_DIR to a directory that holds tiktoken's cached GPT-2 files (currently "
            f"{cache}), or use the character-level tokenizer (train.py data=shakespeare_char; "
            "python -m data.prepare --tokenizer char)."
        ) from e


class GPT2Tokenizer:
    """GPT-2 byte-level BPE without special tokens: ``encode`` reads "<|endoftext|>" as plain text."""

    name = "gpt2"

    def __init__(self) -> None:
        self._enc = _gpt2_encoding()
        self.vocab_size: int = self._enc.n_vocab
        self.encoding: str = self._enc.name  # tiktoken's name of the BPE ("gpt2")

    def vocab_sha256(self) -> str:
        """What the ids mean (two encodings that share a name and size but not their tokens differ here):
        SHA-256 of each token's bytes, length-prefixed, in id order."""
        h = hashlib.sha256()
        for b in map(self._enc.decode_single_token_bytes, range(self.vocab_size)):
            h.update(len(b).to_bytes(4, "little") + b)
        return h.hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_prompt(self, text: str) -> list[int]:
        """As ``encode``, except that "<|endoftext|>" is the end-of-text token (50256), the separator
        between documents, as a user who writes it in a prompt means."""
        return self._enc.encode(text, allowed_special={"<|endoftext|>"})

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        return np.array(self.encode(text), dtype=dtype)

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes that are not valid UTF-8 (a window cut inside a character) decode to U+FFFD."""
        return self._enc.decode(_as_int_list(ids))

    def __repr__(self) -> str:
        return f"GPT2Tokenizer(vocab_size={self.vocab_size})"


class CharTokenizer:
    """Character-level tokenizer: id ``i`` <-> ``itos[i]`` (``prepare``: the corpus's sorted characters)."""

    name = "char"

    def __init__(self, itos: Sequence[str]) -> None:
        itos = list(itos)
        bad = [c for c in itos if not isinstance(c, str) or len(c) != 1]
        if bad:
            raise ValueError(f"char vocabulary entries must be single characters, got {bad[:5]!r}")
        if len(set(itos)) != len(itos):
            raise ValueError("char vocabulary has repeated characters (prepare writes each character once)")
        if len(itos) > MAX_VOCAB:
            raise ValueError(
                f"the text has {len(itos)} distinct characters, more than the {MAX_VOCAB} ids a uint16 "
                "token file can hold; use the GPT-2 tokenizer for this corpus (train.py data.tokenizer=gpt2 "
                "with a data.dir of its own; python -m data.prepare --tokenizer gpt2)"
            )
        self.itos: list[str] = itos
        self.vocab_size: int = len(itos)
        codes = np.array([ord(c) for c in itos], dtype=np.int64)
        self._order = np.argsort(codes)  # a vectorised lookup: code points sorted, and their ids
        self._sorted_codes = codes[self._order]

    def encode_array(self, text: str, dtype=np.int64) -> np.ndarray:
        """ValueError naming the first character outside the vocabulary."""
        if not text:
            return np.zeros(0, dtype=dtype)
        if self.vocab_size == 0:
            raise ValueError("the char vocabulary is empty; it cannot encode any text")
        codes = np.frombuffer(text.encode("utf-32-le", errors="surrogatepass"), dtype="<u4").astype(np.int64)
        pos = np.minimum(np.searchsorted(self._sorted_codes, codes), self.vocab_size - 1)
        unknown = self._sorted_codes[pos] != codes
        if unknown.any():
            first = int(np.flatnonzero(unknown)[0])
            raise ValueError(
                f"character {text[first]!r} (U+{ord(text[first]):04X}) at position {first} is not in this "
                f"{self.vocab_size}-character vocabulary; char-level data must be encoded with the "
                "vocabulary of its own corpus"
            )
        return self._order[pos].astype(dtype)

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    encode_prompt = encode  # no special tokens: every character is one of the corpus's

    def decode(self, ids: Iterable[int]) -> str:
        ids = _as_int_list(ids)
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the char vocabulary [0, {self.vocab_size})")
        return "".join([self.itos[i] for i in ids])

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


def make_tokenizer(name: str, *, itos: Sequence[str] | None = None):
    """Tokenizer ``name``: ``"gpt2"``, or ``"char"`` with its characters ``itos``."""
    if name == "gpt2":
        return GPT2Tokenizer()
    if name == "char":
        if itos is None:
            raise ValueError("the char tokenizer needs its vocabulary: pass itos=...")
        return CharTokenizer(itos)
    raise ValueError(f"unknown tokenizer {name!r}; use one of {TOKENIZERS}")
