"""Vision towers, each a folder: its config, module, processor, HF weight rules, parameter and FLOP counts."""
