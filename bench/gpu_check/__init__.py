"""``python -m bench.gpu_check``: the one command for a bare GPU machine (issues 32, 33, 40).

It needs only PyTorch, numpy, pyarrow, pydantic and PyYAML (transformers for the HF peer
rows, which are skipped without it): nothing on its path imports Ray, MLflow, DVC or
gensim, and a machine without one of the five is told so in one line
(``requirements.py``). In at most 8 minutes on one H100 it measures, each part within its
own time budget and in the order a first GPU run needs them most, and prints as it goes:

- ``loop``: the paper profile's PTB GPT-6 through ``plan_training`` -> ``train_job`` ->
  ``train_local``, one process and N at once on the one GPU;
- ``four``: issue 33's four 6-layer PTB runs with the profile's recipe at once, the
  epochs that fit and the full run's projected time;
- ``sync``: the loop's steps under ``torch.cuda.set_sync_debug_mode("error")``;
- ``gpt2``, ``seq2seq``: the peer rows: our GPT vs HF GPT-2 at GPT-2-small shapes, our
  Transformer and U-Net vs HF BART at the paper's seq2seq size; eager and compiled;
  tokens/s, MFU;
- ``hier``: the HIER attention rows (``bench.bench_hier_attention``) at 300-1,200 history
  tokens;
- ``ptb-curve`` (issue 41; only when named, alone: ``--parts ptb-curve``): GPT-6 fed as
  issue 33's documents and as the reference's stream, at once, with the whole run's
  schedule, each epoch's streamed validation beside the reference's log (``curve.py``).

Each part says how long it took and how much of it was compiling. The run ends with a
summary table (each number beside the issue's target and baseline), written as the GPU
section of ``--results PATH``, or of ``bench/RESULTS.md`` by a CUDA run of every part at
full size that passes (no other run touches it). ``--device cpu --smoke`` runs the same
code paths at toy sizes in a few minutes, the loop compiled by Inductor
(``tests/bench/test_gpu_check.py`` runs it with the cluster stack refused); ``--device
cpu`` without ``--smoke`` is refused. ``cli.py`` says how to add a part.

PTB: the GPU machine has no internet and carries the git tree only: copy Mikolov's
``ptb.{train,valid,test}.txt`` into the git-ignored ``data/raw/ptb`` (read by default) or
pass ``--ptb DIR`` (``ptb.py``).
"""
