"""Measuring compute cost during real training steps: ``loongforge profile`` and online fitting.

``records`` (pure Python) defines the PROFILE.jsonl format that ``balance.fit`` reads; the rest
(timers, recorder, sweep, online fitting) hooks into ``train.runner`` and needs torch.
"""
