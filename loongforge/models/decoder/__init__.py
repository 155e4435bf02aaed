"""What every model family's language model is built from (megatron-core parts, no family facts).

language_model.py  LanguageModel: GPTModel with the vocabulary-padding mask and the loss-masked head
layer_specs.py     the pre-norm block (optional per-head q/k norm, optional MoE MLP) and the decoder block spec
configs.py         the decoder's TransformerConfig and the settings every tower shares
hf_mapping.py      the decoder's rows of an HF weight map (routed experts included)
hf_config.py       the routed-expert fields of an HF config.json, both ways
params.py          parameter counts by arithmetic
gated_delta_net.py Gated DeltaNet, the linear-attention token mixer of hybrid decoders
sparse_attention.py DeepSeek Sparse Attention: the lightning indexer and top-k masked multi-latent attention
linear_attention.py  the gated delta rule in plain torch (and fla's kernel where it imports)
moe_balance.py     mixture-of-experts layers in training: the load-balancing loss, expert loads, padding masks
vocab.py           the embedding's rows for a vocabulary (padding to TP)
"""
