"""launcher: environment parity on every node, then torchrun everywhere through Ray, then
honest per-rank throughput. ``from launcher import report`` feeds a user script's progress
into the same tables (a no-op outside the launcher)."""

from launcher.metrics import report

__version__ = "0.1.0"
__all__ = ["__version__", "report"]
