"""Trained models as MLflow pyfunc models: text in, text (or numbers) out.

- ``generate`` models take a dialogue history (a list of utterance strings, oldest first)
  and return a response string (``params`` may set any ``DecodeConfig`` field);
- ``select`` models take a history and a list of candidate strings and return one score
  per candidate (the model's logit: higher = better);
- ``lm`` models take a document (a list of sentence strings) and return its perplexity.

Input: a pandas DataFrame or a list of dicts (one per row) with columns ``history`` (+
``candidates``) or ``document``. The logged model carries this as its signature (per task,
with the decoding params of ``generate`` models and their defaults) and an input example,
which the MLflow UI shows and ``mlflow models serve`` checks requests against (its types and
columns; unknown params are dropped there). A request the model cannot answer (a param out
of range, an unknown strategy, a missing column, no candidates or an empty one, a document
without a word) raises :class:`RequestError`: served, an HTTP 400 whose JSON ``message`` is
one line naming the field, the bad value and the valid values.

Texts become batches through the data layer's own functions, the ones tokenize and the
loader use (``data.examples.request_dialogue``, the example builders, ``data.loader``'s
collate): a model is served its input exactly as it was trained on it (``tests/
test_serving.py`` compares the two, tensor for tensor, for every task).

The pyfunc carries no pickled torch model: its artifacts are the final checkpoint (loaded
with ``weights_only=True``), the vocabulary and a small spec; the model is rebuilt through
the registry from the config stored in the checkpoint. The ``pipeline`` package travels
with the model (``code_paths``) so it loads where hiertx is not installed; its
``requirements.txt`` pins versions PyPI serves (:func:`pin`).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import mlflow.pyfunc
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE
from mlflow.tracking._tracking_service import utils as tracking_utils

from pipeline.config import CorpusParams, DecodeStrategy, GenerateParams, LMParams, SelectParams
from pipeline.data.batch import GenerateBatch, LMBatch, SelectBatch
from pipeline.data.encoding import EncodedDialogue, encode_dialogues
from pipeline.data.examples import build_lm, build_prompts, build_select, request_dialogue
from pipeline.data.loader import collate_generate, collate_lm, collate_select
from pipeline.data.splits import Split
from pipeline.data.vocab import Vocab
from pipeline.eval.perplexity import perplexity_of
from pipeline.models.saved import load_model
from pipeline.names import Task

SPEC_FILE = "serving.json"
_GLOBAL_URI = threading.Lock()  # mlflow's tracking URI is process-global (tracking_uri_set)
PACKAGE_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class ServingSpec:
    """How raw text becomes a batch (the corpus' tokenize limits)."""

    task: str
    max_history: int | None = 150  # None: the whole conversation
    max_utterances: int | None = 10
    max_response: int = 30
    max_candidate: int = 30
    max_sentence: int | None = 50

    @classmethod
    def of(cls, task: Task | str, corpus: CorpusParams) -> ServingSpec:
        """The spec of a model of ``task`` trained on a corpus tokenized with ``corpus``."""
        return cls(
            task=str(task),
            max_history=corpus.generate.max_history,
            max_utterances=corpus.generate.max_utterances,
            max_response=corpus.generate.max_response,
            max_candidate=corpus.select.max_candidate,
            max_sentence=corpus.lm.max_sentence,
        )


class RequestError(MlflowException, ValueError):
    """A request the model cannot answer, in one line: the field, the bad value and what is
    valid. MLflow's scoring server answers it with HTTP 400 and ``{"error_code":
    "INVALID_PARAMETER_VALUE", "message": <the line>}``; any other exception from
    ``predict`` becomes a 400 whose JSON carries the whole traceback.

    The server prefixes the message of an ``MlflowException`` raised by ``predict`` with
    ``Failed to predict data '<the request's DataFrame>'. \\nError: `` (assigning
    ``e.message``), which makes it several lines long and echoes the whole request: the
    message this error was created with is kept."""

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        return self._message

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_message"):  # the first assignment: MlflowException.__init__
            self._message = value


# --------------------------------------------------------------------------- text -> batch


def candidates_problem(candidates: Sequence[str]) -> str | None:
    """Why a request's candidates cannot be scored, in one line (None: they can): there
    are none, or one has no words (empty or only spaces: its score would be the model's
    reading of ``<bos> <eos>``, and which text it stood for is lost). ``rank`` applies the
    same rule to ``--candidates`` and ``--input``."""
    if not candidates:
        return "no candidates; valid: 1 or more strings with words"
    for k, text in enumerate(candidates):
        if not text.strip():
            return (
                f"candidates[{k}] is empty ({text!r}): an empty candidate cannot be scored; "
                "give it words or leave it out"
            )
    return None


def _encoded(
    rows: Sequence[Sequence[str]], vocab: Vocab, candidates: Sequence[Sequence[str]] | None = None
) -> list[EncodedDialogue]:
    """Each row (a history or a document) as a dialogue encoded as tokenize encodes one."""
    dialogues = [
        request_dialogue(str(i), row, None if candidates is None else candidates[i])
        for i, row in enumerate(rows)
    ]
    return encode_dialogues(dialogues, vocab)


def _history_params(spec: ServingSpec) -> GenerateParams:
    return GenerateParams(
        max_history=spec.max_history,
        max_utterances=spec.max_utterances,
        max_response=spec.max_response,
    )


def generate_batch(
    histories: Sequence[Sequence[str]], vocab: Vocab, spec: ServingSpec
) -> GenerateBatch:
    """Histories -> the batch a generate model decodes from: each history cut exactly as
    the training examples' (``data.examples.build_prompts``: the most recent
    ``max_utterances`` utterances and ``max_history`` tokens; the response speaker is
    "self", so the last utterance is the other party's), collated by the loader."""
    prompts = build_prompts(_encoded(histories, vocab), _history_params(spec))
    return collate_generate(list(prompts))


def select_batch(
    histories: Sequence[Sequence[str]],
    candidates: Sequence[Sequence[str]],
    vocab: Vocab,
    spec: ServingSpec,
) -> SelectBatch:
    """Histories and their candidates -> the batch a select model scores: built as
    tokenize builds a corpus's own candidates (DSTC7) on an evaluation split (every
    candidate kept, in order, cut to ``max_candidate`` tokens), collated by the loader.
    A row whose candidates cannot be scored (:func:`candidates_problem`) raises
    :class:`RequestError`."""
    for i, row in enumerate(candidates):
        problem = candidates_problem(row)
        if problem is not None:
            raise RequestError(f"row {i}: {problem}")
    dialogues = _encoded(histories, vocab, candidates)
    params = SelectParams(max_candidate=spec.max_candidate)
    examples = build_select(dialogues, params, _history_params(spec), Split.TEST, seed=0)
    return collate_select(list(examples))


def lm_batch(documents: Sequence[Sequence[str]], vocab: Vocab, spec: ServingSpec) -> LMBatch:
    """Documents -> the batch an LM scores: built as tokenize builds documents (a sentence
    with no words is left out, each sentence cut to ``max_sentence`` tokens), one document
    per row however many sentences it has, collated by the loader. A document with no
    words at all raises :class:`RequestError`."""
    dialogues = _encoded(documents, vocab)
    for i, d in enumerate(dialogues):
        if not any(len(u) for u in d.utterances):
            raise RequestError(
                f"row {i}: column 'document' has no words (every sentence is empty); "
                "valid: 1 or more sentences with words"
            )
    whole = max(len(d.utterances) for d in dialogues)  # no request's document is split
    params = LMParams(sentences_per_document=whole, max_sentence=spec.max_sentence)
    return collate_lm(list(build_lm(dialogues, params)))


# --------------------------------------------------------------------------- the pyfunc


def _records(model_input: Any) -> list[dict[str, Any]]:
    if hasattr(model_input, "to_dict"):  # pandas DataFrame
        return list(model_input.to_dict(orient="records"))
    if isinstance(model_input, dict):
        return [model_input]
    return list(model_input)


def _column(records: list[dict[str, Any]], name: str) -> list[list[str]]:
    """Column ``name`` of every row, each a list of strings (a JSON array or a numpy array
    of them, as MLflow passes it)."""
    rows = []
    for i, record in enumerate(records):
        if name not in record:
            have = ", ".join(map(repr, record)) or "none"
            raise RequestError(
                f"row {i}: missing column {name!r} (a list of strings); columns given: {have}"
            )
        value = record[name]
        if isinstance(value, str | bytes) or not hasattr(value, "__iter__"):
            raise RequestError(
                f"row {i}: column {name!r} is {type(value).__name__} {value!r}; "
                "valid: a list of strings"
            )
        rows.append([str(t) for t in value])
    return rows


def _valid_values(name: str) -> str:
    """What ``DecodeConfig`` field ``name`` accepts, in words (from its declaration)."""
    from pipeline.decode import DecodeConfig

    field = DecodeConfig.model_fields[name]
    if name == "strategy":
        return ", ".join(s.value for s in DecodeStrategy)
    kind = field.annotation.__name__ if isinstance(field.annotation, type) else "a value"
    if kind == "bool":
        return "true or false"
    words = {"int": "an integer", "float": "a number"}.get(kind, kind)
    bounds = [
        f"{symbol} {getattr(rule, attr)}"
        for rule in field.metadata
        for attr, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
        if getattr(rule, attr, None) is not None
    ]
    return f"{words} {' and '.join(bounds)}" if bounds else words


def decode_config(params: dict[str, Any], max_length: int) -> Any:
    """The ``DecodeConfig`` of a request's ``params`` (``max_length`` defaults to
    ``max_length``); a bad one raises :class:`RequestError` naming each bad param, its
    value and the valid values."""
    from pydantic import ValidationError

    from pipeline.decode import DecodeConfig

    given = {"max_length": max_length, **params}
    try:
        return DecodeConfig(**given)
    except ValidationError as err:
        problems = []
        for error in err.errors():
            if error["loc"]:  # one field's type or range
                name = str(error["loc"][0])
                if error["type"] == "extra_forbidden":
                    valid = ", ".join(DecodeConfig.model_fields)
                    problems.append(f"params: unknown param {name!r}; valid params: {valid}")
                    continue
                problems.append(
                    f"params.{name}: {error['input']!r} is not valid; "
                    f"valid values: {_valid_values(name)}"
                )
            else:  # a rule across fields (DecodeConfig._check): "<field>: <rule>"
                rule = str(error["ctx"]["error"]) if "ctx" in error else error["msg"]
                name, _, why = rule.partition(": ")
                fields = DecodeConfig.model_fields
                value = given.get(name, fields[name].default if name in fields else None)
                others = [
                    f"{f} = {given.get(f, fields[f].default)!r}"
                    for f in fields
                    if f != name and f in why
                ]
                context = f" ({', '.join(others)})" if others else ""
                problems.append(f"params.{name}: {value!r} is not valid: {why}{context}")
        raise RequestError("; ".join(problems)) from None


class HiertxModel(mlflow.pyfunc.PythonModel):
    """A trained hiertx model behind MLflow's pyfunc ``predict``."""

    def load_context(self, context: Any) -> None:
        self.load(
            context.artifacts["checkpoint"], context.artifacts["vocab"], context.artifacts["spec"]
        )

    def load(self, checkpoint: str | Path, vocab: str | Path, spec: str | Path) -> None:
        self.model = load_model(Path(checkpoint))
        self.vocab = Vocab.load(vocab)
        self.spec = ServingSpec(**json.loads(Path(spec).read_text()))

    # A DataFrame hint is one MLflow accepts without inferring a schema from it (the
    # signature logged with the model is the schema); no hint at all makes MLflow warn, on
    # every import, that predict() should have one.
    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> list[Any]:
        """Answers, one per row of ``model_input`` (see the module docstring)."""
        records = _records(model_input)
        if not records:
            return []
        task = Task(self.spec.task)
        with torch.no_grad():
            if task == Task.GENERATE:
                return self._generate(_column(records, "history"), params or {})
            if task == Task.SELECT:
                batch = select_batch(
                    _column(records, "history"),
                    _column(records, "candidates"),
                    self.vocab,
                    self.spec,
                )
                scores = self.model.score(batch)
                return [
                    row[: len(r["candidates"])].tolist()
                    for row, r in zip(scores, records, strict=True)
                ]
            batch = lm_batch(_column(records, "document"), self.vocab, self.spec)
            nll = (self.model.token_nll(batch) * batch.sentence_mask).sum(dim=(1, 2))
            n = batch.sentence_mask.sum(dim=(1, 2)).clamp(min=1)
            return [perplexity_of(float(v)) for v in nll / n]

    def _generate(self, histories: list[list[str]], params: dict[str, Any]) -> list[str]:
        from pipeline.decode import generate

        config = decode_config(params, self.spec.max_response)
        out = generate(self.model, generate_batch(histories, self.vocab, self.spec), config)
        return [
            self.vocab.decode(row[:n].tolist())
            for row, n in zip(out.tokens, out.lengths, strict=True)
        ]


EXAMPLE_HISTORY = ["hi , how are you ?", "fine thanks , and you ?"]


def _param_spec(name: str, default: Any) -> Any:
    """A ``DecodeConfig`` field as an MLflow param (its type and default)."""
    from enum import Enum

    from mlflow.types import DataType, ParamSpec

    if isinstance(default, bool):
        kind = DataType.boolean
    elif isinstance(default, int):
        kind = DataType.long
    elif isinstance(default, float):
        kind = DataType.double
    else:
        kind, default = DataType.string, default.value if isinstance(default, Enum) else default
    return ParamSpec(name, kind, default)


def model_signature(spec: ServingSpec) -> Any:
    """What the model takes and returns, per task; ``generate`` models also take every
    ``DecodeConfig`` field as a param (``max_length`` defaults to the corpus'
    ``max_response``)."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, Schema
    from mlflow.types.schema import Array

    from pipeline.decode import DecodeConfig

    texts = Array(DataType.string)
    task = Task(spec.task)
    if task == Task.GENERATE:
        defaults = {"max_length": spec.max_response}
        params = ParamSchema(
            [
                _param_spec(name, defaults.get(name, field.default))
                for name, field in DecodeConfig.model_fields.items()
            ]
        )
        return ModelSignature(
            Schema([ColSpec(texts, "history")]), Schema([ColSpec(DataType.string)]), params
        )
    if task == Task.SELECT:
        return ModelSignature(
            Schema([ColSpec(texts, "history"), ColSpec(texts, "candidates")]),
            Schema([ColSpec(Array(DataType.double))]),
        )
    return ModelSignature(Schema([ColSpec(texts, "document")]), Schema([ColSpec(DataType.double)]))


def input_example(spec: ServingSpec) -> pd.DataFrame:
    """One request of the model's task (shown on the model's page in MLflow)."""
    task = Task(spec.task)
    if task == Task.GENERATE:
        return pd.DataFrame({"history": [EXAMPLE_HISTORY]})
    if task == Task.SELECT:
        candidates = ["i am fine too", "the train leaves at five"]
        return pd.DataFrame({"history": [EXAMPLE_HISTORY], "candidates": [candidates]})
    return pd.DataFrame({"document": [EXAMPLE_HISTORY]})


# What the pyfunc imports where it is served: the code it carries (``pipeline``, see
# ``code_paths``) imports these at load or predict time (tokenizers: a BPE vocabulary).
SERVED_DISTRIBUTIONS = (
    "torch",
    "mlflow",
    "pydantic",
    "numpy",
    "pandas",
    "pyarrow",
    "pyyaml",
    "tokenizers",
)


def pin(distribution: str, installed: str) -> str:
    """``distribution==<version>`` that pip can resolve from PyPI: the installed version's
    public part. A local version label (PEP 440 ``+...``: ``torch 2.13.0+cpu`` from the
    PyTorch CPU index, ``+cu128``, a ``+g<hash>`` source build) names a build PyPI never
    serves, and ``==2.13.0+cpu`` matches no PyPI release; ``==2.13.0`` does."""
    from packaging.version import Version

    return f"{distribution}=={Version(installed).public}"


def pip_requirements() -> list[str]:
    """What the pyfunc needs to load, pinned to this environment's versions (see
    :func:`pin`)."""
    from importlib.metadata import version

    return [pin(pkg, version(pkg)) for pkg in SERVED_DISTRIBUTIONS]


@contextlib.contextmanager
def tracking_uri_set(uri: str) -> Iterator[None]:
    """MLflow's process-global tracking URI set to ``uri`` for the block, for the MLflow
    calls that use no other (``pyfunc.log_model``; ``pyfunc.load_model`` of a ``models:/``
    URI, whose registry lookup takes no URI). Restored exactly as it was, with the
    ``MLFLOW_TRACKING_URI`` that ``set_tracking_uri`` exports (``get_tracking_uri()``
    would return the variable's value and, set back, pin it for the rest of the process
    even after the variable changes); one block at a time (seeds trained at once log from
    threads of one process)."""
    with _GLOBAL_URI:
        previous_uri = tracking_utils._tracking_uri
        previous_env = os.environ.get(tracking_utils.MLFLOW_TRACKING_URI.name)
        mlflow.set_tracking_uri(uri)
        try:
            yield
        finally:
            mlflow.set_tracking_uri(previous_uri)  # type: ignore[arg-type]  # None unsets it
            if previous_env is None:
                os.environ.pop(tracking_utils.MLFLOW_TRACKING_URI.name, None)
            else:
                os.environ[tracking_utils.MLFLOW_TRACKING_URI.name] = previous_env


def log_pyfunc(
    uri: str,
    run_id: str,
    registered_name: str | None,
    *,
    checkpoint: str | Path,
    vocab: str | Path,
    spec: ServingSpec,
    name: str = "model",
) -> str | None:
    """Log the pyfunc into run ``run_id`` of store ``uri`` (and register a new version of
    ``registered_name``). Returns the registered version, or ``None``.

    ``mlflow.pyfunc.log_model`` only uses the process-global tracking URI: it is set for
    the call (:func:`tracking_uri_set`)."""
    with tracking_uri_set(uri), tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / SPEC_FILE
        spec_path.write_text(json.dumps(asdict(spec)))
        with mlflow.start_run(run_id=run_id):
            info = mlflow.pyfunc.log_model(
                name=name,
                python_model=HiertxModel(),
                artifacts={
                    "checkpoint": str(checkpoint),
                    "vocab": str(vocab),
                    "spec": str(spec_path),
                },
                code_paths=[str(PACKAGE_DIR)],
                pip_requirements=pip_requirements(),
                signature=model_signature(spec),
                input_example=input_example(spec),
                registered_model_name=registered_name,
            )
    version = info.registered_model_version
    return None if version is None else str(version)
