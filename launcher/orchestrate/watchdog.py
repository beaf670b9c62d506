"""Stops the Ray a launch started when the launcher itself is killed (``kill -9``, the OOM killer).

python -m launcher.orchestrate.watchdog LAUNCHER_PID
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import time
from typing import Any

from launcher.orchestrate.reaper import descendants, end_noted, started

SCAN_S = 1.0
GRACE_S = 3.0


def main(argv: list[str]) -> int:
    launcher = int(argv[0])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle
    record: dict[str, Any] = {}
    noted: dict[int, int] = {}  # pid → start time
    buffer = b""
    scanned = 0.0
    while os.getppid() == launcher:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], 0.2)
        if ready:
            chunk = os.read(sys.stdin.fileno(), 65536)
            if not chunk:
                break  # the launcher's end of the pipe closed: it is gone
            buffer += chunk
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
        if record.get("mode") == "embedded" and time.monotonic() - scanned > SCAN_S:
            for pid in descendants(launcher):
                if pid != os.getpid() and pid not in noted and (start := started(pid)):
                    noted[pid] = start
            scanned = time.monotonic()
    if record.get("mode") == "embedded":
        end_noted(noted, GRACE_S)
        from launcher.orchestrate.ray_cluster import remove_ray_temp

        remove_ray_temp(record["temp_dir"])
    elif record.get("mode") == "bootstrap":
        from launcher.orchestrate.ray_cluster import stop_ray
        from launcher.spec import ClusterSpec

        cluster = ClusterSpec.model_validate(record["cluster"])
        nodes = [n for name in record["nodes"] for n in cluster.nodes if n.name == name]
        stop_ray(cluster, nodes, record["addresses"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
