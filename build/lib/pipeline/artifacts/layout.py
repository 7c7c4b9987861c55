"""Where every stage reads and writes: the one place that spells the project's paths."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

SOURCES_FILE = "SOURCES.json"
MANIFEST_FILE = "manifest.json"
VOCAB_FILE = "vocab.json"
ACTS_FILE = "acts.json"
MODEL_FILE = "model.pt"
BEST_FILE = "best.json"
SEEDS_FILE = "seeds.json"
PER_EXAMPLE_FILE = "per_example.jsonl"
SAMPLES_FILE = "samples.md"
METRICS_DIR = "metrics"


@dataclass(frozen=True)
class Layout:
    """Where the stages read and write, relative to the project ``root``."""

    root: Path

    @property
    def data_dir(self) -> Path:
        """Every stage output but the metrics (git-ignored): the folders below, and what
        workers on other nodes must see at the same path."""
        return self.root / "data"

    @property
    def sources_dir(self) -> Path:
        """The check stage's output: a :meth:`declaration` per corpus."""
        return self.data_dir / "sources"

    @property
    def raw_dir(self) -> Path:
        """The download stages' outputs: a :meth:`raw` folder per corpus."""
        return self.data_dir / "raw"

    @property
    def shards_dir(self) -> Path:
        """The tokenize stages' outputs: a :meth:`shards` folder per corpus."""
        return self.data_dir / "shards"

    def declaration(self, corpus: str) -> Path:
        """Where a corpus comes from, as the check stage read it from params."""
        return self.sources_dir / f"{corpus}.json"

    def raw(self, corpus: str) -> Path:
        """The downloaded corpus (download stage)."""
        return self.raw_dir / corpus

    def shards(self, corpus: str) -> Path:
        """The tokenized corpus: vocabulary, act inventory, Arrow shards, manifest."""
        return self.shards_dir / corpus

    def tune_out(self, key: str) -> Path:
        return self.data_dir / "tune" / key

    def train_out(self, key: str) -> Path:
        return self.data_dir / "train" / key

    def eval_out(self, key: str) -> Path:
        return self.data_dir / "eval" / key

    def metrics(self, key: str) -> Path:
        """Run ``key``'s aggregated test metrics (git-tracked, DVC metrics)."""
        return self.root / METRICS_DIR / f"{key}.json"

    def trained_runs(self) -> list[str]:
        """Keys of the runs with a train record."""
        return sorted(p.parent.name for p in (self.data_dir / "train").glob(f"*/{MANIFEST_FILE}"))

    def relative(self, path: Path) -> str:
        """``path`` relative to the project (records stay valid when the project moves)."""
        try:
            return str(path.resolve().relative_to(self.root.resolve()))
        except ValueError:
            return str(path)

    def resolve(self, path: str) -> Path:
        """A path a record holds, made absolute (records keep them project-relative)."""
        p = Path(path)
        return p if p.is_absolute() else self.root / p
