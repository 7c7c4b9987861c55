"""Vocabularies: text <-> token ids, with the special tokens of ``special.py`` first.

Three kinds share one interface. ``word``: a regex word tokenizer (punctuation split off,
optional lower-casing) and the most frequent training words. ``whitespace``: the same for
text that is already tokenised (split on spaces only: Mikolov's PTB, whose ``<unk>`` is the
special unknown word). ``bpe``: a byte-pair encoding trained with HF ``tokenizers`` on the
same text. Either way a vocabulary is
built from the TRAINING split only, and ``content_hash`` identifies it in manifests.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from pipeline.config import VocabParams
from pipeline.data.special import PAD, SPECIAL_TOKENS, UNK, UNK_ID
from pipeline.errors import DataError

FORMAT_VERSION = 1

# One token: a delexicalised placeholder ``[hotel_area]`` (kept whole; it needs an ``_``,
# so "[laughs]" stays three tokens), a markup token such as PTB's ``<unk>``, a word with
# inner apostrophes ("don't"), or one other non-space character (punctuation).
_PLACEHOLDER = r"\[[^\W\d_]+(?:_[^\W_]+)+\]"
_WORD_RE = re.compile(_PLACEHOLDER + r"|<[^\W\d_]+>|\w+(?:'\w+)*|[^\w\s]")
_PLACEHOLDER_RE = re.compile(_PLACEHOLDER)

# Joins texts for one-pass tokenization: a punctuation token of its own, so no token spans it.
_SEPARATOR = "\x00"

# Kept when decoding with strip_special: an unknown word is still a word of the output.
_STRIPPED = frozenset(SPECIAL_TOKENS) - {UNK}


def word_tokenize(text: str, lowercase: bool = True) -> list[str]:
    """Split ``text`` into words and punctuation marks (``"Hi, you!"`` -> ``hi , you !``)."""
    text = text.replace(_SEPARATOR, " ")
    return _WORD_RE.findall(text.lower() if lowercase else text)


def is_placeholder(token: str) -> bool:
    """True for a delexicalisation placeholder such as ``[hotel_area]``."""
    return _PLACEHOLDER_RE.fullmatch(token) is not None


class _Lookup(dict):
    """token -> id with ``<unk>`` for misses (``map(d.__getitem__, ...)`` runs in C)."""

    def __missing__(self, key: str) -> int:
        return UNK_ID


class Vocab:
    """Token <-> id mapping; ids of ``special.SPECIAL_TOKENS`` are fixed (``<pad>`` = 0, ...).

    Build one with :func:`build_vocab`; persist with :meth:`save` / :meth:`load`.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        kind: Literal["word", "bpe", "whitespace"] = "word",
        lowercase: bool = True,
        bpe_json: str | None = None,
    ) -> None:
        if tuple(tokens[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise ValueError(f"a vocabulary must start with {SPECIAL_TOKENS}")
        if len(set(tokens)) != len(tokens):
            raise ValueError("vocabulary tokens must be unique")
        if (kind == "bpe") != (bpe_json is not None):
            raise ValueError("a bpe vocabulary needs its tokenizer JSON (and only bpe has one)")
        self.tokens: tuple[str, ...] = tuple(tokens)
        self.kind = kind
        self.lowercase = lowercase
        self._bpe_json = bpe_json
        self._stoi = {t: i for i, t in enumerate(self.tokens)}
        self._bpe = None
        if bpe_json is not None:
            from tokenizers import Tokenizer

            self._bpe = Tokenizer.from_str(bpe_json)
            if self._bpe.get_vocab_size(with_added_tokens=True) != len(self.tokens):
                raise ValueError("bpe tokenizer size does not match the token list")

    def __len__(self) -> int:
        return len(self.tokens)

    def __contains__(self, token: str) -> bool:
        return token in self._stoi

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocab) and self.content_hash == other.content_hash

    def __hash__(self) -> int:
        return hash(self.content_hash)

    def __repr__(self) -> str:
        return f"Vocab(kind={self.kind!r}, size={len(self)}, hash={self.content_hash[:12]})"

    def id(self, token: str) -> int:
        """The id of ``token`` (``<unk>``'s id if unknown)."""
        return self._stoi.get(token, UNK_ID)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (no ``<bos>``/``<eos>``: callers add what their task needs)."""
        if self._bpe is not None:
            return self._bpe.encode(text, add_special_tokens=False).ids
        get = self._stoi.get
        return [get(w, UNK_ID) for w in self._words(text)]

    def _words(self, text: str) -> list[str]:
        if self.kind == "whitespace":
            return (text.lower() if self.lowercase else text).split()
        return word_tokenize(text, self.lowercase)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """``encode`` of every text as int32 arrays, much faster than one by one.

        Word vocabularies tokenize all texts in one regex pass over their concatenation
        (a separator no token can span marks the boundaries); BPE encodes in parallel.
        """
        if self._bpe is not None:
            encoded = self._bpe.encode_batch(list(texts), add_special_tokens=False)
            return [np.array(e.ids, dtype=np.int32) for e in encoded]
        if not texts:
            return []
        if self.kind == "whitespace":
            lookup = _Lookup(self._stoi)
            return [np.array([lookup[w] for w in self._words(t)], dtype=np.int32) for t in texts]
        joined = _SEPARATOR.join(t.replace(_SEPARATOR, " ") for t in texts)
        tokens = _WORD_RE.findall(joined.lower() if self.lowercase else joined)
        lookup = _Lookup(self._stoi)
        lookup[_SEPARATOR] = -1
        ids = np.fromiter(map(lookup.__getitem__, tokens), dtype=np.int32, count=len(tokens))
        bounds = np.flatnonzero(ids < 0)
        lengths = np.diff(bounds, prepend=-1, append=len(ids)) - 1
        return np.split(ids[ids >= 0], np.cumsum(lengths[:-1]))

    def decode(self, ids: Iterable[int], strip_special: bool = True) -> str:
        """Text of ``ids``; ``strip_special`` drops ``<pad> <bos> <eos> <sep>`` (not ``<unk>``).

        Word vocabularies join tokens with single spaces (the tokenized form, which is
        what BLEU and distinct-n compare); BPE undoes its own word splitting.
        """
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} outside the vocabulary (size {len(self)})")
        if strip_special:
            ids = [i for i in ids if self.tokens[i] not in _STRIPPED]
        if self._bpe is not None:
            return self._bpe.decode(ids, skip_special_tokens=False)
        return " ".join(self.tokens[i] for i in ids)

    @property
    def content_hash(self) -> str:
        """sha256 of everything that determines the id of a text (tokens, kind, casing)."""
        return hashlib.sha256(self._canonical().encode()).hexdigest()

    def _canonical(self) -> str:
        return json.dumps(self._payload(), sort_keys=True, ensure_ascii=False)

    def _payload(self) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "kind": self.kind,
            "lowercase": self.lowercase,
            "tokens": list(self.tokens),
            "bpe": self._bpe_json,
        }

    def save(self, path: str | Path) -> None:
        """Write the vocabulary as JSON, atomically (a BPE tokenizer is stored inside)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(self._payload(), ensure_ascii=False, indent=0) + "\n")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path) -> Vocab:
        """Read a vocabulary written by :meth:`save`; a ``DataError`` says what is wrong."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise DataError(path, "vocabulary file not found; run the tokenize stage") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(path, f"not a vocabulary JSON file ({err})") from None
        if not isinstance(raw, dict) or raw.get("format") != FORMAT_VERSION:
            raise DataError(path, f"unknown vocabulary format (expected {FORMAT_VERSION})")
        try:
            return cls(raw["tokens"], raw["kind"], raw["lowercase"], raw.get("bpe"))
        except (KeyError, TypeError, ValueError) as err:
            raise DataError(path, f"invalid vocabulary: {err}") from None


def build_vocab(texts: Iterable[str], params: VocabParams, reserved: Sequence[str] = ()) -> Vocab:
    """A vocabulary of at most ``params.size`` tokens (every type if None) from (training)
    ``texts``.

    ``reserved`` tokens (delexicalisation placeholders) always get ids, right after the
    special tokens, and are never split. Word kind: the most frequent words with at least
    ``min_freq`` occurrences, ties broken by the word itself.
    """
    reserved = tuple(dict.fromkeys(t for t in reserved if t not in SPECIAL_TOKENS))
    size = params.size if params.size is not None else 2**62
    room = size - len(SPECIAL_TOKENS) - len(reserved)
    if room < 0:
        raise ValueError(
            f"vocab size {params.size} leaves no room for {len(reserved)} reserved tokens"
        )
    if params.kind == "bpe":
        return _build_bpe(texts, params, reserved)
    counts = count_tokens(texts, params)
    for token in (*SPECIAL_TOKENS, *reserved):
        counts.pop(token, None)
    # Count descending, then the token itself: the result is a function of the text alone.
    ranked = sorted(
        (t for t, c in counts.items() if c >= params.min_freq), key=lambda t: (-counts[t], t)
    )
    return Vocab([*SPECIAL_TOKENS, *reserved, *ranked[:room]], params.kind, params.lowercase)


def count_tokens(texts: Iterable[str], params: VocabParams, batch: int = 65_536) -> Counter[str]:
    """How often each word of ``texts`` occurs, tokenized as a ``params.kind`` vocabulary
    tokenizes. Texts are joined ``batch`` at a time (one regex pass per batch is much faster
    than one per text, and a batch bounds the memory); no token spans the newline that
    joins them, so the counts are those of the texts one by one."""
    counts: Counter[str] = Counter()
    it = iter(texts)
    while chunk := list(itertools.islice(it, batch)):
        joined = "\n".join(chunk)
        if params.kind == "whitespace":
            counts.update((joined.lower() if params.lowercase else joined).split())
        else:
            counts.update(word_tokenize(joined, params.lowercase))
    return counts


def _build_bpe(texts: Iterable[str], params: VocabParams, reserved: tuple[str, ...]) -> Vocab:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    steps = [normalizers.NFKC()] + ([normalizers.Lowercase()] if params.lowercase else [])
    tok.normalizer = normalizers.Sequence(steps)
    # Metaspace keeps word boundaries in the pieces, so decode restores the spacing;
    # Punctuation splits "you!" the way the word tokenizer does.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(), pre_tokenizers.Punctuation()]
    )
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=params.size - len(reserved),
        min_frequency=params.min_freq,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if reserved:
        tok.add_tokens(list(reserved))
    size = tok.get_vocab_size(with_added_tokens=True)
    tokens = [tok.id_to_token(i) for i in range(size)]
    if tokens[0] != PAD or tokens[: len(SPECIAL_TOKENS)] != list(SPECIAL_TOKENS):
        raise RuntimeError("tokenizers did not give the special tokens their fixed ids")
    return Vocab(tokens, "bpe", params.lowercase, tok.to_str())
