"""The model manager keeps a loaded model's objects out of the garbage collector's walks."""

from __future__ import annotations

import gc
from pathlib import Path

from engine_daemon.models.manager import ModelManager
from engine_daemon.models.store import ModelRef


def test_load_freezes_the_heap_and_unload_thaws_it(tiny_model: Path) -> None:
    """A full collection after a load walks only what was made since (`_freeze_heap`); unload lets the
    collector reach the old model again, so a switched-out model is still freed."""
    gc.unfreeze()
    manager = ModelManager()
    try:
        loaded = manager.ensure(ModelRef(id="tiny", path=tiny_model))
        assert gc.get_freeze_count() > 1000  # the model, its tokenizer and everything imported to load them
        tracked = {id(obj) for obj in gc.get_objects()}
        assert id(loaded.tokenizer) not in tracked and id(loaded.model) not in tracked
    finally:
        manager.unload()
    assert gc.get_freeze_count() == 0
