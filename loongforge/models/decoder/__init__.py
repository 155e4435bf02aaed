"""What every model family's language model is built from (megatron-core parts, no family facts).

language_model.py  LanguageModel: GPTModel with the vocabulary-padding mask and the loss-masked head
layer_specs.py     the pre-norm block (optional per-head q/k norm, optional MoE MLP) and the decoder block spec
configs.py         the decoder's TransformerConfig and the settings every tower shares
hf_mapping.py      the decoder's rows of an HF weight map (routed experts included)
hf_config.py       the routed-expert fields of an HF config.json, both ways
params.py          parameter counts by arithmetic
"""
