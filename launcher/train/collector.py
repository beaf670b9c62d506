"""Python's cyclic garbage collector kept off the GPU's critical path.

After ``torch.compile`` a training process holds millions of Python objects (graphs, guards,
symbolic shapes). CPython's automatic collections run when allocation counts say so, and a
collection of the older generations walks all of them, pausing the training thread; once the
host's lead over the GPU runs out, the GPU waits. On GPUs the trainer therefore:

1. collects everything once and freezes the survivors (``gc.freeze``: never scanned again)
   near the end of the warm-up, after compilation and CUDA-graph recording;
2. turns automatic collection off;
3. collects the young generations (``gc.collect(1)``) on each log step, when the host has
   queued the next step (``Meter(read_late=True)``), so the GPU is busy meanwhile.

Reference counting frees most objects as before; only garbage cycles wait for the next log
step (or, once they reach the oldest generation, for the end of the run). ``close`` puts the
collector back as it was.
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
