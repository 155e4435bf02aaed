"""Benchmarks behind ``loongforge bench``: simulations and measurements, no CLI code."""
