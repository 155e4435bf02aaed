"""How many rows a model's embedding and output layer have for a vocabulary (torch-free: the
family contract and the dry-run plan read it without a model)."""

from __future__ import annotations

import math

# Megatron pads the vocabulary so the output GEMM splits evenly and stays aligned; 128 keeps Qwen's
# vocabularies (151936 = 128*1187, 152064 = 128*1188) unpadded at every power-of-two TP size,
# so checkpoints do not change shape with TP.
VOCAB_PAD_MULTIPLE = 128


def padded_vocab_size(vocab_size: int, tensor_parallel_size: int) -> int:
    """Smallest size >= vocab_size divisible by lcm(VOCAB_PAD_MULTIPLE, TP)."""
    multiple = math.lcm(VOCAB_PAD_MULTIPLE, tensor_parallel_size)
    return -(-vocab_size // multiple) * multiple
