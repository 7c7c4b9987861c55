"""Training at scale.

- ``loop``: one worker's loop for every model and task (local, Ray Train or Ray Tune);
- ``checkpoint``, ``seed``: resumable state (atomic, weights-only files; RNG capture);
- ``optim``: Adam/AdamW and the learning-rate schedules;
- ``job``: the picklable model and data factories built from the registry and the shards;
- ``distributed``: Ray Train (TorchTrainer, DDP) and the cluster connection;
- ``tune``: Ray Tune with Optuna (TPE) and ASHA over the same loop;
- ``run``: the train and tune stages' logic (params -> outputs, MLflow tracking).
"""
