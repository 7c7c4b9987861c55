#!/usr/bin/env bash
# Peak memory and time of the tokenize stage on a generated chat corpus (issue 49):
#   bench/tokenize_memory.sh CHECKOUT CORPUS.jsonl WORKDIR [CHUNK_DIALOGUES]
# CHECKOUT: the hiertx checkout whose stage runs (with its .venv); WORKDIR: a scratch
# project folder (params of profiles/custom.yaml, vocabulary 30k, the corpus declared as
# an absolute path). Prints /usr/bin/time -v's wall time, CPU time and max RSS.
set -euo pipefail
checkout=$(realpath "$1"); corpus=$(realpath "$2"); work=$3
mkdir -p "$work" && cd "$work"
sed -e "s|file: examples/chat.jsonl.*|file: $corpus|" -e "s|size: 2000|size: 30000|" \
    "$checkout/profiles/custom.yaml" > params.yaml
if [ -n "${4:-}" ]; then sed -i "s|^tokenize:|tokenize:\n  chunk_dialogues: $4|" params.yaml; fi
export PYTHONPATH=$checkout
"$checkout/.venv/bin/python" - <<'PY'
from pipeline.config import load_params
from pipeline.data.download import download_corpus
params = load_params("params.yaml")
download_corpus("mychats", "data/raw", params.download, False, params.corpus("mychats").source)
PY
/usr/bin/time -v "$checkout/.venv/bin/python" -m stages.tokenize mychats --params params.yaml \
    --raw data/raw --out data/shards --no-progress 2> time.txt | tail -3
grep -E "Elapsed|User time|System time|Maximum resident" time.txt
