"""Calibrating the cost model balancing uses: ``loongforge profile`` and ``loongforge fit-cost``.

- ``profile_run``: real training steps (``train.run_training``) with every rank's micro-batch
  compute recorded into PROFILE.jsonl;
- ``sweep``: the designed grid of lengths and image sizes ``profile --sweep`` trains on;
- ``fit_cost``: PROFILE.jsonl -> COST.json, with held-out and cross-validated accuracy.

The measuring itself (timers, recorder, the PROFILE.jsonl format) is ``loongforge.profile``.
"""
