"""Imported last by the fork server (``fork_server.start``): moves everything the preload created into
the collector's permanent generation (``gc.freeze``).

A forked rank's first full collection (``train.step.ManualGC`` collects once before its first step,
then after every N-th step) otherwise walks every object of torch, megatron-core and transformers that
the server imported: 0.35 s of CPU per rank on a 2-core machine, every launch. Frozen, those objects
are never scanned nor freed (they live as long as the process anyway), and the children's pages that
hold them stay shared with the server instead of being copied when a collection touches them.
"""

import gc

gc.collect()
gc.freeze()
