"""loongforge: load-balanced training of vision-language models on megatron-core."""

__version__ = "0.1.0"
