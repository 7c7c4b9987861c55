"""Small batches for model tests: random layouts and real text from chitchat / PTB.

Built directly (a plain word vocabulary, the batch conventions of ``pipeline.data.batch``)
so model tests depend on the batch contract only, not on the tokenization stage.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
from collections import Counter
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from pipeline.data.batch import GenerateBatch, History, LMBatch, SelectBatch
from pipeline.data.special import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    SPEAKER_OTHER,
    SPEAKER_SELF,
    SPECIAL_TOKENS,
    UNK_ID,
)

REPO = Path(__file__).resolve().parents[1]
_WORD = re.compile(r"[a-z0-9']+|[^\sa-z0-9']")


@cache
def shared_dir(entry: str, marker: str) -> Path:
    """``shared/<entry>``, the folder the project's tests read real data from: beside this
    checkout or, for a clone of a local repository (a fresh CI clone), beside its origin;
    the first that holds ``marker``. Without one, the first candidate (for the error
    message)."""
    candidates = [REPO.parent / "shared" / entry]
    origin = subprocess.run(
        ["git", "-C", str(REPO), "config", "--get", "remote.origin.url"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    if origin and Path(origin).is_dir():
        candidates.append(Path(origin).resolve().parent / "shared" / entry)
    found = [path for path in candidates if (path / marker).is_file()]
    return (found or candidates)[0]


def shared_data_dir() -> Path:
    """The real corpora mirror: ``$HIERTX_TEST_DATA``, else ``shared/data``
    (:func:`shared_dir`)."""
    if "HIERTX_TEST_DATA" in os.environ:
        return Path(os.environ["HIERTX_TEST_DATA"])
    return shared_dir("data", "MANIFEST.tsv")


def _pad(rows: list[list[int]], length: int | None = None) -> tuple[Tensor, Tensor]:
    length = length or max(len(r) for r in rows)
    ids = torch.full((len(rows), length), PAD_ID, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return ids, ids != PAD_ID


def make_history(utterances: list[list[list[int]]], speakers: list[list[int]]) -> History:
    """``utterances[b]`` = encoded utterances (oldest first, each ``<bos> .. <eos>``)."""
    rows, idx, pos, spk = [], [], [], []
    for utts, spks in zip(utterances, speakers, strict=True):
        rows.append([t for u in utts for t in u])
        idx.append([i for i, u in enumerate(utts) for _ in u])
        pos.append([p for u in utts for p in range(len(u))])
        spk.append([s for u, s in zip(utts, spks, strict=True) for _ in u])
    ids, mask = _pad(rows)
    length = ids.shape[1]

    def pad_to(values: list[list[int]]) -> Tensor:
        out = torch.zeros(len(values), length, dtype=torch.long)
        for i, v in enumerate(values):
            out[i, : len(v)] = torch.tensor(v, dtype=torch.long)
        return out

    return History(ids, mask, pad_to(idx), pad_to(pos), pad_to(spk))


def random_generate_batch(
    batch_size: int = 3,
    vocab_size: int = 50,
    max_utterances: int = 4,
    max_utt_len: int = 6,
    max_target: int = 7,
    seed: int = 0,
    n_acts: int | None = None,
) -> GenerateBatch:
    """Random token ids with a realistic layout: varied utterance counts and lengths, so rows
    carry different amounts of padding."""
    g = torch.Generator().manual_seed(seed)

    def words(n: int) -> list[int]:
        return torch.randint(len(SPECIAL_TOKENS), vocab_size, (n,), generator=g).tolist()

    def rand(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    utts, spks, targets = [], [], []
    for _ in range(batch_size):
        n = rand(1, max_utterances)
        utts.append([[BOS_ID, *words(rand(1, max_utt_len - 2)), EOS_ID] for _ in range(n)])
        spks.append([SPEAKER_SELF if (n - i) % 2 == 0 else SPEAKER_OTHER for i in range(n)])
        targets.append([BOS_ID, *words(rand(1, max_target - 2)), EOS_ID])
    target_ids, target_mask = _pad(targets)
    acts = None
    if n_acts is not None:
        acts = (torch.rand(batch_size, n_acts, generator=g) < 0.2).float()
    return GenerateBatch(
        history=make_history(utts, spks),
        target_ids=target_ids,
        target_mask=target_mask,
        turn=torch.tensor([len(u) for u in utts]),
        dialogue_id=tuple(f"rand-{i}" for i in range(batch_size)),
        acts=acts,
    )


# --------------------------------------------------------------------------- real text


@cache
def chitchat_dialogues(limit: int = 200) -> tuple[tuple[str, ...], ...]:
    """The first ``limit`` multi-turn chitchat conversations as tuples of turn texts."""
    import chitchat_dataset

    path = Path(chitchat_dataset.__file__).with_name("dataset.json")
    data = json.loads(path.read_text())
    dialogues = []
    for conv in data.values():
        turns = tuple(" ".join(m["text"] for m in turn) for turn in conv["messages"])
        if len(turns) >= 2:
            dialogues.append(turns)
        if len(dialogues) == limit:
            break
    return tuple(dialogues)


class WordVocab:
    """Lower-cased regex words; the ``size`` most frequent words of ``texts``."""

    def __init__(self, texts: list[str], size: int) -> None:
        counts = Counter(w for t in texts for w in _WORD.findall(t.lower()))
        kept = sorted(counts, key=lambda w: (-counts[w], w))[: size - len(SPECIAL_TOKENS)]
        self.itos = [*SPECIAL_TOKENS, *kept]
        self.stoi = {w: i for i, w in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, text: str, limit: int = 30) -> list[int]:
        return [self.stoi.get(w, UNK_ID) for w in _WORD.findall(text.lower())[:limit]]


def chitchat_generate_batch(
    batch_size: int = 8, vocab_size: int = 1000, max_history: int = 60
) -> tuple[GenerateBatch, WordVocab]:
    """Real (history, response) pairs from chitchat; the last turn of each conversation is
    the response, up to 4 previous turns are the history (most recent ``max_history``
    tokens)."""
    dialogues = chitchat_dialogues()[:batch_size]
    vocab = WordVocab([t for d in chitchat_dialogues() for t in d], vocab_size)
    utts, spks, targets = [], [], []
    for turns in dialogues:
        history = turns[-5:-1]
        encoded = [[BOS_ID, *vocab.encode(t, 20), EOS_ID] for t in history]
        while sum(map(len, encoded)) > max_history:
            encoded.pop(0)
        n = len(encoded)
        utts.append(encoded)
        spks.append([SPEAKER_SELF if (n - i) % 2 == 0 else SPEAKER_OTHER for i in range(n)])
        targets.append([BOS_ID, *vocab.encode(turns[-1], 20), EOS_ID])
    target_ids, target_mask = _pad(targets)
    batch = GenerateBatch(
        history=make_history(utts, spks),
        target_ids=target_ids,
        target_mask=target_mask,
        turn=torch.tensor([len(d) - 1 for d in dialogues]),
        dialogue_id=tuple(str(i) for i in range(batch_size)),
    )
    return batch, vocab


def chitchat_select_batch(
    batch_size: int = 8, n_candidates: int = 5, vocab_size: int = 1000
) -> tuple[SelectBatch, WordVocab]:
    """Real contexts with the true response and negatives taken from other conversations;
    the true response sits at a different position in each row."""
    gen, vocab = chitchat_generate_batch(batch_size + n_candidates, vocab_size)
    responses = [row[m].tolist() for row, m in zip(gen.target_ids, gen.target_mask, strict=True)]
    cand_rows, labels = [], torch.zeros(batch_size, n_candidates)
    for b in range(batch_size):
        negatives = [responses[(b + k) % len(responses)] for k in range(1, n_candidates)]
        gold = b % n_candidates
        cands = [*negatives[:gold], responses[b], *negatives[gold:]]
        cand_rows.append(cands)
        labels[b, gold] = 1.0
    length = max(len(c) for cands in cand_rows for c in cands)
    candidate_ids = torch.stack([_pad(cands, length)[0] for cands in cand_rows])
    history = History(
        *(
            t[:batch_size]
            for t in (
                gen.history.input_ids,
                gen.history.input_mask,
                gen.history.utt_index,
                gen.history.utt_pos,
                gen.history.speaker,
            )
        )
    )
    batch = SelectBatch(
        history=history,
        candidate_ids=candidate_ids,
        candidate_mask=candidate_ids != PAD_ID,
        labels=labels,
        dialogue_id=gen.dialogue_id[:batch_size],
    )
    return batch, vocab


def lm_batch_from_sentences(documents: list[list[list[int]]]) -> LMBatch:
    """``documents[b][s]`` = token ids of sentence s (each ending with ``<eos>``)."""
    n_sent = max(len(d) for d in documents)
    length = max(len(s) for d in documents for s in d)
    sentences = torch.full((len(documents), n_sent, length), PAD_ID, dtype=torch.long)
    for b, doc in enumerate(documents):
        for s, sent in enumerate(doc):
            sentences[b, s, : len(sent)] = torch.tensor(sent)
    flat_ids, flat_mask = _pad([[t for s in d for t in s] for d in documents])
    return LMBatch(
        sentences=sentences,
        sentence_mask=sentences != PAD_ID,
        flat_ids=flat_ids,
        flat_mask=flat_mask,
        dialogue_id=tuple(str(i) for i in range(len(documents))),
    )


def ptb_lm_batch(
    batch_size: int = 4, sentences_per_document: int = 4, vocab_size: int = 2000
) -> tuple[LMBatch, WordVocab]:
    """Real Penn Treebank documents (consecutive training sentences)."""
    lines = (shared_data_dir() / "ptb" / "ptb.train.txt").read_text().splitlines()[:3000]
    vocab = WordVocab(lines, vocab_size)
    vocab.stoi["<unk>"] = UNK_ID  # PTB writes rare words as <unk>
    docs = []
    for b in range(batch_size):
        chunk = lines[b * sentences_per_document : (b + 1) * sentences_per_document]
        docs.append([[*[vocab.stoi.get(w, UNK_ID) for w in s.split()][:25], EOS_ID] for s in chunk])
    return lm_batch_from_sentences(docs), vocab


def tensors(batch: object) -> list[Tensor]:
    """Every tensor of ``batch``, its history's included, in field order."""
    out: list[Tensor] = []
    for f in dataclasses.fields(batch):  # type: ignore[arg-type]
        value = getattr(batch, f.name)
        if isinstance(value, Tensor):
            out.append(value)
        elif isinstance(value, History):
            out.extend(tensors(value))
    return out
