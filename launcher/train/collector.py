"""Python's cyclic garbage collector kept off the GPU's critical path: frozen after the
warm-up, then run on log steps only.
"""

from __future__ import annotations

import gc


class ManualCollector:
    """``after_step(step, logged)`` after every optimizer step; ``close()`` at the end."""

    def __init__(self, *, enabled: bool, freeze_at: int):
        self.enabled = enabled
        self.freeze_at = freeze_at  # the step after which the survivors are frozen
        self.frozen = False
        self._was_enabled = True

    def after_step(self, step: int, logged: bool) -> None:
        if not self.enabled:
            return
        if not self.frozen:
            if step >= self.freeze_at:
                gc.collect()
                gc.freeze()
                self._was_enabled = gc.isenabled()
                gc.disable()
                self.frozen = True
        elif logged:
            gc.collect(1)

    def close(self) -> None:
        if self.frozen:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
            self.frozen = False
