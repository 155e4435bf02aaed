"""The building blocks every part (tower, projector, decoder layer) is made of, no family facts.

layer_backend.py   which implementation a block is built from (Transformer Engine, flash-attn, SDPA): the one seam
attention.py       the core attention modules of megatron-core's local layer specs (packed rows, CP)
fp8.py             FP8 linears through ``torch._scaled_mm`` (no Transformer Engine)
lora.py            LoRA adapters on megatron-core's parallel linears (PEFT's math and names)
lora_params.py     how many parameters a LoRA configuration trains
layer_kinds.py     a block linear's kind by its module name (what FP8 and LoRA select by)
initialization.py  initial weights keyed by (seed, what they are): one model at every layout
"""
