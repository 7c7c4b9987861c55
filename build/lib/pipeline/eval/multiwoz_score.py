"""``python -m pipeline score multiwoz``: Inform and Success of a MultiWOZ predictions file.

    python -m pipeline score multiwoz --predictions FILE.json --data DIR \\
        [--scheme standardized|official]

``FILE.json`` is the format the field exchanges (the predictions folder of
Tomiinek/MultiWOZ_Evaluation): ``{"sng0073": [{"response": "...", "state": {...}?,
"active_domains": [...]?}, ...], ...}``, dialogue ids lowercased without ``.json``, one entry
per system turn. ``DIR`` holds a release's ``test.json`` (or ``test.json.zip``; the content
of the ConvLab zips) and ``db/``. Progress goes to stderr; the last line of stdout is one
JSON object: ``scheme``, ``inform``, ``success`` (0-100), ``inform_by_domain``,
``success_by_domain``, ``dialogues``, and what the scheme could not read.

Schemes:

- ``standardized`` (default): Nekvinda & Dusek 2021, the scheme of the MultiWOZ README's
  table (``pipeline.eval.multiwoz_standard``): every published delexicalisation style,
  fuzzy database matching, the predicted state where the file has one.
- ``official``: the original evaluator the HT-Encoder paper was scored with
  (``pipeline.eval.multiwoz``): ``[domain_slot]`` placeholders only, ground-truth states.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Any

from pipeline.data.dialogue import Dialogue
from pipeline.data.formats import ParseContext, load_json
from pipeline.data.formats import multiwoz as multiwoz_format
from pipeline.data.splits import Split
from pipeline.errors import DataError
from pipeline.eval import multiwoz as official
from pipeline.eval.multiwoz_db import MultiWozDB
from pipeline.eval.multiwoz_standard import Prediction, standardized_rates

COMMAND = "score"


class Scheme(StrEnum):
    """How Inform and Success are computed (module docstring)."""

    STANDARDIZED = "standardized"
    OFFICIAL = "official"


def load_predictions(path: Path) -> dict[str, list[Prediction]]:
    """A predictions file (module docstring), checked whole: a ``DataError`` names the
    file and the dialogue and turn that do not fit."""
    if not path.is_file():
        raise DataError(path, "no such predictions file; give --predictions FILE.json")
    data = load_json(path)
    if not isinstance(data, dict):
        raise DataError(path, "expected a JSON object {dialogue_id: [turn, ...]}")
    out: dict[str, list[Prediction]] = {}
    for did, turns in data.items():
        if not isinstance(turns, list):
            raise DataError(path, f"dialogue {did!r}: expected a list of turns")
        parsed = []
        for i, turn in enumerate(turns):
            where = f"dialogue {did!r}, turn {i}"
            if not isinstance(turn, dict) or not isinstance(turn.get("response"), str):
                raise DataError(path, f"{where}: expected an object with a 'response' string")
            state, domains = turn.get("state"), turn.get("active_domains")
            if state is not None and not _is_state(state):
                raise DataError(path, f"{where}: 'state' must be {{domain: {{slot: value}}}}")
            if domains is not None and not (
                isinstance(domains, list) and all(isinstance(d, str) for d in domains)
            ):
                raise DataError(path, f"{where}: 'active_domains' must be a list of names")
            parsed.append(Prediction(turn["response"], state, domains))
        out[did.lower().removesuffix(".json")] = parsed
    if not out:
        raise DataError(path, "no dialogues to score")
    return out


def _is_state(state: Any) -> bool:
    return isinstance(state, dict) and all(
        isinstance(slots, dict) and all(isinstance(v, str) for v in slots.values())
        for slots in state.values()
    )


def load_test_dialogues(data: Path) -> dict[str, Dialogue]:
    """The test dialogues of a MultiWOZ release folder, keyed by lowercased id."""
    if not data.is_dir():
        raise DataError(data, "no such folder; give --data DIR holding test.json and db/")
    dialogues = multiwoz_format.read(data, Split.TEST, ParseContext())
    return {d.id.lower(): d for d in dialogues}


def score(
    predictions: Mapping[str, Sequence[Prediction]],
    dialogues: Mapping[str, Dialogue],
    db: MultiWozDB,
    scheme: Scheme,
) -> dict[str, Any]:
    """Inform and Success of ``predictions`` in ``scheme``, as the command prints them."""
    missing = sorted(set(predictions) - set(dialogues))
    if missing:
        raise ValueError(
            f"{len(missing)} predicted dialogues are not in the test data (first: {missing[:3]}); "
            "is --data the right release?"
        )
    if scheme is Scheme.STANDARDIZED:
        rates = standardized_rates(dialogues, predictions, db)
        return {
            "scheme": scheme.value,
            "inform": rates.inform,
            "success": rates.success,
            "inform_by_domain": rates.inform_by_domain,
            "success_by_domain": rates.success_by_domain,
            "dialogues": rates.dialogues,
            "unknown_placeholders": rates.unknown_placeholders,
            "turn_count_mismatches": rates.turn_count_mismatches,
        }
    responses = {dialogues[d].id: [p.response for p in turns] for d, turns in predictions.items()}
    result = official.inform_success([dialogues[did] for did in predictions], responses, db)
    total: Counter[str] = Counter()
    informed: Counter[str] = Counter()
    succeeded: Counter[str] = Counter()
    for outcome in result.outcomes:
        for domain in outcome.domains:
            total[domain.domain] += 1
            informed[domain.domain] += domain.informed
            succeeded[domain.domain] += outcome.inform and domain.succeeded
    return {
        "scheme": scheme.value,
        "inform": round(result.inform, 1),
        "success": round(result.success, 1),
        "inform_by_domain": {d: round(100 * informed[d] / total[d], 1) for d in sorted(total)},
        "success_by_domain": {d: round(100 * succeeded[d] / total[d], 1) for d in sorted(total)},
        "dialogues": len(result.outcomes),
    }


def add_parser(commands: Any) -> None:
    """The ``score`` subcommand of ``python -m pipeline``."""
    sub = commands.add_parser(COMMAND, help="score a predictions file with a field's scorer")
    corpora = sub.add_subparsers(dest="corpus", required=True)
    mwz = corpora.add_parser("multiwoz", help="MultiWOZ Inform and Success", description=__doc__)
    mwz.formatter_class = argparse.RawDescriptionHelpFormatter
    mwz.add_argument("--predictions", required=True, type=Path, help="predictions JSON file")
    mwz.add_argument("--data", required=True, type=Path, help="folder with test.json and db/")
    mwz.add_argument(
        "--scheme",
        choices=[s.value for s in Scheme],
        default=Scheme.STANDARDIZED.value,
        help="which evaluator scores the file (see Schemes above)",
    )


def run_command(args: argparse.Namespace) -> int:
    """Run ``score multiwoz``: progress to stderr, the scores as JSON on stdout."""
    scheme = Scheme(args.scheme)
    print(f"score: reading {args.predictions}", file=sys.stderr)
    predictions = load_predictions(args.predictions)
    print(f"score: reading the test dialogues and db/ of {args.data}", file=sys.stderr)
    dialogues = load_test_dialogues(args.data)
    db = MultiWozDB.load(args.data)
    print(f"score: {len(predictions)} dialogues, {scheme.value} scheme", file=sys.stderr)
    try:
        result = score(predictions, dialogues, db, scheme)
    except ValueError as err:
        print(f"{COMMAND}: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result))
    return 0
