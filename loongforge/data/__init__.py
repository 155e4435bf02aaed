"""Data: conversation files and synthetic samples -> tokens and pixels -> packed micro-batches.

Entry points: ``DataPipeline`` (training steps), ``load_tokenizer``, ``FileSamples`` /
``SyntheticSamples`` (sample sources), ``SampleMeasurer`` (tokens + media sizes of one sample).
The micro-batch contract is documented in ``loongforge.data.collate``.
"""

from loongforge.data.pipeline import DataPipeline
from loongforge.data.records import REJECT_REASONS, ConversationSample, Reject
from loongforge.data.tokenizer import load_tokenizer

__all__ = ["DataPipeline", "REJECT_REASONS", "ConversationSample", "Reject", "load_tokenizer"]
