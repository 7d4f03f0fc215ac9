"""freeze_heap: keep the objects of a process's start-up out of the collector's full passes.

A full pass of the garbage collector traverses every tracked object and runs on whichever
thread allocates at the wrong moment: often a step loop, stalling that step and the GPU behind
it, or the serving thread with every stream behind it. With a 131k tokenizer and torch loaded a
process tracks ~210k objects, and a full pass over them takes ~40 ms on two CPU cores (the
probe in docs/serving.md "Host time"); frozen, a full pass has almost nothing to traverse.
Both processes call it once they are up (and grammar_service after each tokenizer load): what
it freezes (imports, the model, the tokenizer) lives as long as the process anyway.
"""
from __future__ import annotations

import gc


def freeze_heap() -> int:
    """Collect, then move every object alive now out of the collector's reach (gc.freeze);
    how many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
