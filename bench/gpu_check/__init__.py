"""``python -m bench.gpu_check``: the one command for a bare GPU machine (issues 32, 33).

It needs only PyTorch, numpy, pyarrow, pydantic and PyYAML (transformers for the HF peer
rows, which are skipped without it): nothing on its path imports Ray, MLflow, DVC or
gensim. In at most 8 minutes on one H100 it measures, each part within its own time
budget, and prints as it goes:

- the peer rows (``peers``): our GPT vs HF GPT-2 at GPT-2-small shapes, our Transformer
  and U-Net vs HF BART at the paper's seq2seq size; eager and compiled; tokens/s, MFU;
- the loop (``loop``): the paper profile's PTB GPT-6 through ``plan_training`` ->
  ``train_job`` -> ``train_local``, one process and N at once on the one GPU;
- issue 33's four 6-layer PTB runs with the profile's recipe at once, the epochs that fit
  and the full run's projected time;
- the loop's steps under ``torch.cuda.set_sync_debug_mode("error")``;
- the HIER attention rows (``bench.bench_hier_attention``) at 300-1,200 history tokens.

It ends with a summary table (each number beside the issue's target and baseline) and
writes it all into ``bench/RESULTS.md``'s GPU section (``--results``). ``--device cpu
--smoke`` runs the same code paths at toy sizes in well under 2 minutes
(``tests/bench/test_gpu_check.py`` runs it with the cluster stack refused).

PTB: the GPU machine has no internet and carries the git tree only: copy Mikolov's
``ptb.{train,valid,test}.txt`` under the git-ignored ``data/raw/ptb`` and pass
``--ptb data/raw/ptb`` (``ptb.py``).
"""
