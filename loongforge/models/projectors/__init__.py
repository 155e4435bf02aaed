"""Projectors: vision features -> language-model tokens (one module per kind)."""
