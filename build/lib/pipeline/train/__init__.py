"""Training at scale, from a run plan (``pipeline.plan``) to exported weights.

- ``training`` / ``tuning``: the train and tune stages' logic (plan -> outputs, MLflow);
- ``job``: a plan's model and data factories (picklable: Ray ships them to workers);
- ``loop`` (+ ``context``, ``steps``): one worker's loop for every model and task, local,
  on Ray Train or in a Ray Tune trial;
- ``checkpoint``, ``seed``: resumable state (atomic, weights-only, versioned; RNG capture);
- ``optim``: Adam/AdamW (fused on CUDA, foreach elsewhere) and the learning-rate schedules;
- ``averaging``: the weight average of a run's last epochs (uniform or EMA), what it
  evaluates, keeps and exports;
- ``distributed``: Ray Train (TorchTrainer, DDP); ``search`` (+ ``tune_progress``): Ray
  Tune with Optuna (TPE) and ASHA over the same loop;
- ``tracked``: a training's MLflow run.
"""
