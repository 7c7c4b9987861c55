"""Data layer: corpus sources and parsers -> ``Dialogue`` records (tokenization lives beside it).

``read_corpus(name, root, split)`` is the entry point; ``pipeline.data.corpora.CORPORA``
lists the corpora, ``pipeline.data.download`` fetches them.
"""

from pipeline.data.corpora import CORPORA, CorpusSpec, SourceFile, read_corpus
from pipeline.data.dialogue import Dialogue, Turn
from pipeline.data.formats import ParseStats
from pipeline.data.splits import Split, assign_splits

__all__ = [
    "CORPORA",
    "CorpusSpec",
    "Dialogue",
    "ParseStats",
    "SourceFile",
    "Split",
    "Turn",
    "assign_splits",
    "read_corpus",
]
