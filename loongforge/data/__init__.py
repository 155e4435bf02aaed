"""Data: conversation, Alpaca, caption and pretraining-text files and synthetic samples -> tokens
and pixels -> packed micro-batches.

Entry points: ``DataPipeline`` (training steps), ``load_tokenizer``, ``ArrowSamples`` /
``SyntheticSamples`` (sample sources), ``SampleMeasurer`` (tokens + media sizes of one sample).
The micro-batch contract is documented in ``loongforge.data.collate``.

Imports are lazy so that pure modules (``loongforge.data.packing``) load without torch.
"""

from importlib import import_module

_EXPORTS = {
    "DataPipeline": "loongforge.data.pipeline",
    "ArrowSamples": "loongforge.data.arrow_samples",
    "FileSamples": "loongforge.data.conversations",
    "SyntheticSamples": "loongforge.data.synthetic",
    "SampleMeasurer": "loongforge.data.measure",
    "ConversationSample": "loongforge.data.samples",
    "TextSample": "loongforge.data.samples",
    "RecordReading": "loongforge.data.record_kinds",
    "Reject": "loongforge.data.samples",
    "REJECT_REASONS": "loongforge.data.samples",
    "load_tokenizer": "loongforge.data.tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'loongforge.data' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
