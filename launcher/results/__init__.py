"""Throughput tables for a run (summary) and for a scaling study (scaling).

Not to be confused with ``launcher.report``, the function user scripts call to record their
progress (``launcher.metrics.report``): this package reads those records back.
"""
