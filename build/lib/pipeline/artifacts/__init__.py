"""The stage contract: where every stage writes (:mod:`.layout`), the typed JSON records it
writes (:mod:`.records`) and the tensor files (:mod:`.files`: exported models, checkpoints).

Stages talk to each other only through files, and every reader and writer goes through
this package, so a field added here reaches every stage, and a stale or foreign file is a
:class:`~pipeline.errors.DataError` naming it, before any compute. It imports nothing of
the project above ``config``.
"""

from pipeline.artifacts.files import SavedModel, TensorRecord, read_tensors, write_tensors
from pipeline.artifacts.layout import (
    ACTS_FILE,
    BEST_FILE,
    MANIFEST_FILE,
    METRICS_DIR,
    MODEL_FILE,
    PER_EXAMPLE_FILE,
    SAMPLES_FILE,
    SEEDS_FILE,
    SOURCES_FILE,
    VOCAB_FILE,
    Layout,
)
from pipeline.artifacts.records import (
    WALL_SECONDS,
    DataSizes,
    DownloadRecord,
    EvalRecord,
    ExampleResult,
    MlflowRef,
    Record,
    SeedMetrics,
    ShardFile,
    SourceDeclaration,
    TokenizeRecord,
    TokenizeSettings,
    TrainedSeed,
    TrainRecord,
    TuneRecord,
    VerifiedFile,
    read_examples,
    read_json,
    read_metrics,
    read_train,
    write_examples,
    write_json,
    write_metrics,
)

__all__ = [
    "ACTS_FILE",
    "BEST_FILE",
    "MANIFEST_FILE",
    "METRICS_DIR",
    "MODEL_FILE",
    "PER_EXAMPLE_FILE",
    "SAMPLES_FILE",
    "SEEDS_FILE",
    "SOURCES_FILE",
    "VOCAB_FILE",
    "WALL_SECONDS",
    "DataSizes",
    "DownloadRecord",
    "EvalRecord",
    "ExampleResult",
    "Layout",
    "MlflowRef",
    "Record",
    "SavedModel",
    "SeedMetrics",
    "ShardFile",
    "SourceDeclaration",
    "TensorRecord",
    "TokenizeRecord",
    "TokenizeSettings",
    "TrainRecord",
    "TrainedSeed",
    "TuneRecord",
    "VerifiedFile",
    "read_examples",
    "read_json",
    "read_metrics",
    "read_tensors",
    "read_train",
    "write_examples",
    "write_json",
    "write_metrics",
    "write_tensors",
]
