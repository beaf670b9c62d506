"""Detached jobs on Ray Jobs: ``launch submit`` and the commands that follow a job.

- ``head.py``: the launcher's own local Ray head for detached jobs on this machine (token
  auth, dashboard and Jobs API on 127.0.0.1, its own temp dir), found again through a small
  private state file; the records of bootstrapped clusters kept up for their jobs.
- ``api.py``: how the commands reach a cluster's Jobs API (that local head, a bootstrapped
  head through an SSH tunnel, an attached cluster as it is) and the queries they make.
- ``state.py``: the state lines a driver writes into its log (pending and why, the latest
  step, the summary's figures) and what ``status`` makes of them.
- ``queue.py``: one job at a time where jobs need the same GPUs or CPU slots, in submission
  order (a pure decision plus a named actor that holds who runs).
- ``driver.py``: the Ray Job's entrypoint on the head: waits its turn, then runs the same
  ``Launch`` as a foreground run, attached to that node's Ray.
- ``commands.py``: submit, status, logs, stop, list, fetch, down.
- ``ssh.py``: the SSH layer's part in this (the tunnel's connection, copying a run directory).
"""
