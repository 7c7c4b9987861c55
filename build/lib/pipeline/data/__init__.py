"""Data layer: corpus sources and parsers -> ``Dialogue`` records -> tokenized example shards.

``pipeline.data.corpora.read_corpus(name, root, split)`` reads a corpus, built-in or declared
in params; ``pipeline.data.download`` fetches it, ``pipeline.data.tokenize`` turns it into
shards, ``pipeline.data.loader`` batches them. Importing this package loads none of them.
"""
