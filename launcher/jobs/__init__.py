"""Detached jobs on Ray Jobs: ``launch submit`` and the commands that follow a job.

The local head (``head``), the Jobs API (``api``), the driver on the head (``driver``), the
queue (``queue``), the state lines (``state``) and the commands (``commands``).
"""
