"""Kaizen's trainer, in two parts with one direction.

* `trainer.control`: the torch-free control plane the gateway runs: the typed policy configuration, rewards and
  scoring, RULER, the scheduler, the evaluation gate, and the typed job a training child is started with.
* `trainer.learner`: the learner, only ever imported by a training process (`python -m trainer.learner`) or a
  model job's (`trainer.learner.initial_adapter`, `trainer.learner.gguf_conversion`): data selection, grouping
  and resampling, tokens, the GRPO and SFT losses, the model and the training job.

`trainer.learner` may import `trainer.control`; nothing outside a training process imports `trainer.learner`
(`tests/unit/test_import_rules.py` checks it).
"""
