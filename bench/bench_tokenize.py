"""Tokenization throughput: hiertx's example builders vs a plain per-example Python loop.

Both candidates turn the same parsed chitchat conversations (the first ``--dialogues``) and
the same vocabulary into the same generate examples (history = the 10 previous turns cut to
their most recent 150 tokens, ``utt_index``/``utt_pos``/``speaker``, target of at most 30
tokens) and write them as one Arrow shard:

- ``hiertx``: ``encode_dialogues`` (every text encoded once, one regex pass) +
  ``build_generate`` (histories gathered for all examples with a few numpy calls) +
  ``write_shards``;
- ``python loop``: for each example, tokenize and look up each history turn, build the
  lists, truncate, then ``pa.array`` the lists (what a straightforward implementation does).

The two outputs are checked equal before timing. Then the whole corpus (every conversation,
every task in ``params.yaml``) is tokenized once with ``tokenize_corpus``, as the DVC stage
does. Run: ``python -m bench.bench_tokenize`` (``--dialogues 200 --repeats 1`` for a smoke
test).
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pyarrow as pa

from bench.common import interleaved, parser, setup, table, timing_cells
from pipeline.artifacts import TokenizeRecord
from pipeline.config import GenerateParams, load_params
from pipeline.data.corpora import read_corpus
from pipeline.data.dialogue import Dialogue
from pipeline.data.encoding import encode_dialogues, vocab_texts
from pipeline.data.examples import build_generate
from pipeline.data.shards import ShardTable, write_manifest, write_shards
from pipeline.data.special import BOS_ID, EOS_ID, SPEAKER_OTHER, SPEAKER_SELF, UNK_ID
from pipeline.data.tokenize import tokenize_corpus
from pipeline.data.vocab import Vocab, build_vocab, word_tokenize
from pipeline.names import Task

REPO = Path(__file__).resolve().parents[1]


def python_loop(dialogues: list[Dialogue], vocab: Vocab, p: GenerateParams, out: Path) -> int:
    """The baseline: one example at a time, Python lists, then Arrow."""
    stoi = {t: i for i, t in enumerate(vocab.tokens)}
    columns: dict[str, list] = {k: [] for k in ("dialogue_id", "turn", "input_ids", "utt_index",
                                                "utt_pos", "speaker", "target_ids")}  # fmt: skip
    for d in dialogues:
        for t in range(1, len(d.turns)):
            if not d.turns[t].text:
                continue
            ids: list[int] = []
            index: list[int] = []
            pos: list[int] = []
            spk: list[int] = []
            for n, u in enumerate(range(max(0, t - p.max_utterances), t)):
                words = [stoi.get(w, UNK_ID) for w in word_tokenize(d.turns[u].text)]
                tokens = [BOS_ID, *words, EOS_ID]
                same = d.turns[u].speaker == d.turns[t].speaker
                ids += tokens
                index += [n] * len(tokens)
                pos += list(range(len(tokens)))
                spk += [SPEAKER_SELF if same else SPEAKER_OTHER] * len(tokens)
            cut = max(0, len(ids) - p.max_history)
            ids, index, pos, spk = ids[cut:], index[cut:], pos[cut:], spk[cut:]
            first, shift = index[0], pos[0]
            index = [i - first for i in index]
            pos = [q - shift if i == 0 else q for q, i in zip(pos, index, strict=True)]
            words = [stoi.get(w, UNK_ID) for w in word_tokenize(d.turns[t].text)]
            for key, value in zip(columns, (d.id, t, ids, index, pos, spk,
                                            [BOS_ID, *words[: p.max_response - 2], EOS_ID]),
                                  strict=True):  # fmt: skip
                columns[key].append(value)
    ints = pa.list_(pa.int32())
    arrays = [pa.array(columns["dialogue_id"]), pa.array(columns["turn"], pa.int32())]
    arrays += [pa.array(columns[k], ints) for k in list(columns)[2:]]
    batch = pa.RecordBatch.from_arrays(arrays, names=list(columns))
    path = str(out / "baseline.arrow")
    with pa.OSFile(path, "wb") as sink, pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return batch.num_rows


def hiertx(dialogues: list[Dialogue], vocab: Vocab, p: GenerateParams, out: Path) -> int:
    table_ = build_generate(encode_dialogues(dialogues, vocab), p)
    write_shards(out, Task.GENERATE, "train", table_, 1_000_000)
    return len(table_)


def check_equal(dialogues: list[Dialogue], vocab: Vocab, p: GenerateParams, out: Path) -> None:
    """Both candidates produce the same rows (read back from their files)."""
    table_ = build_generate(encode_dialogues(dialogues, vocab), p)
    files = write_shards(out, Task.GENERATE, "train", table_, len(table_))
    shards = {"generate": {"train": files.shards}}
    record = TokenizeRecord(
        corpus="bench",
        vocab_hash=vocab.content_hash,
        vocab_size=len(vocab),
        vocab_words=len(vocab),
        shards=shards,
        target_tokens={"generate": {"train": table_.scored_tokens()}},
    )
    write_manifest(out, record)
    ours = ShardTable(out, Task.GENERATE, "train")
    python_loop(dialogues, vocab, p, out)
    with pa.memory_map(str(out / "baseline.arrow")) as source:
        theirs = pa.ipc.open_file(source).read_all().to_pylist()
    assert len(theirs) == len(ours), (len(theirs), len(ours))
    for row, example in zip(theirs, ours, strict=True):
        for key, value in row.items():
            mine = getattr(example, key)
            assert (mine.tolist() if hasattr(mine, "tolist") else mine) == value, key


def main() -> None:
    p = parser(__doc__.splitlines()[0], precision=False)  # no model runs
    p.add_argument("--dialogues", type=int, default=1000, help="conversations timed per repeat")
    p.add_argument("--params", default=str(REPO / "params.yaml"))
    p.set_defaults(repeats=3, warmup=1)
    args = p.parse_args()
    env = setup(args)
    start = time.perf_counter()
    parsed = [d for d in read_corpus("chitchat") if d.meta["split"] == "train"]
    parse_s = time.perf_counter() - start
    dialogues = parsed[: args.dialogues]
    vocab = build_vocab(vocab_texts(parsed), load_params(args.params).corpus("chitchat").vocab)
    params = GenerateParams()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        check_equal(dialogues, vocab, params, out / "check")
        rows = hiertx(dialogues, vocab, params, out / "h")
        (out / "b").mkdir()
        cases = {
            "hiertx": lambda: hiertx(dialogues, vocab, params, out / "h"),
            "python loop": lambda: python_loop(dialogues, vocab, params, out / "b"),
        }
        samples = interleaved(cases, args.repeats, args.warmup)
        start = time.perf_counter()
        manifest = tokenize_corpus("chitchat", None, out / "full", load_params(args.params))
        full_s = time.perf_counter() - start
    base = samples["python loop"].median
    rows_out = [
        [name, *timing_cells(s, 1.0), rows / s.median, base / s.median]
        for name, s in samples.items()
    ]
    print(env.markdown())
    print(f"\nGenerate examples from {len(dialogues):,} chitchat training conversations "
          f"({rows:,} examples; median of {args.repeats} interleaved runs):\n")  # fmt: skip
    print(table(["candidate", "median s", "IQR s", "examples/s", "speed-up"], rows_out))
    ratio = base / samples["hiertx"].median
    print(f"\nhiertx / python loop: {ratio:.1f}x")
    total = sum(n for by_split in manifest.counts.values() for n in by_split.values())
    counts = ", ".join(f"{t} {sum(s.values()):,}" for t, s in manifest.counts.items())
    print(f"\nWhole corpus (tokenize_corpus, params.yaml: {counts}): {full_s:.1f} s")
    print(f"= {total / full_s:,.0f} examples/s (of which parsing the JSON: ~{parse_s:.1f} s)")


if __name__ == "__main__":
    main()
