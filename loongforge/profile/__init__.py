"""Measuring compute cost during real training steps: a pure measuring library.

``timers`` (megatron's timer hooks, the gradient-sync clock), ``recorder`` (one step -> records),
``features`` (a micro-batch -> the cost model's features), ``profile_file`` (the PROFILE.jsonl
format that ``balance.fit`` reads). Commands that use it: ``loongforge.calibrate`` (profile,
fit-cost) and ``train.balancing`` (the online fit).
"""
