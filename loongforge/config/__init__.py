"""Typed run configuration: schema, YAML presets and overrides, validation.

Import from the submodules (``loongforge.config.loader``, ``loongforge.config.validate``); this
package imports nothing heavy so that ``loongforge --help`` stays fast.
"""
