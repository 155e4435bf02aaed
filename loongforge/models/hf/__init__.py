"""HF checkpoints <-> megatron state dicts, for any family: the vocabulary of a family's weight map and
the walk over it.

rules.py             ``Rule`` rows and the ``Transform``s they use (what a family's ``hf_rules`` returns)
weights.py           HF state dicts <-> one rank's megatron state dict, walking the family's rules
state_dict_names.py  where a layer's norm weights live in megatron state dicts (one naming, one legacy)
"""
