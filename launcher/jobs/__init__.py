"""Detached jobs on Ray Jobs: ``launch submit`` and the commands that follow a job."""
