"""Heartbeats to NVIDIA Resiliency Extension's rank monitor, when its ft_launcher (``recipes.launch --nvrx``) started
this rank: the step boundaries the hang watchdog sees are sent to it too. ft_launcher watches them from outside the
rank — a hang that holds the GIL in native code escapes the watchdog's thread, not a separate process — and ends
and restarts the workers when they stop for ``--ft-rank-heartbeat-timeout`` seconds (``--ft-initial-rank-heartbeat-
timeout`` until the first step ends)."""

from __future__ import annotations

import os

# Set by ft_launcher for each rank it starts: the socket of that rank's monitor.
RANK_MONITOR_SOCKET = "FT_RANK_MONITOR_IPC_SOCKET"


class RankMonitorHeartbeats:
    """Does nothing unless ft_launcher started this rank."""

    def __init__(self) -> None:
        self.client = None
        if os.environ.get(RANK_MONITOR_SOCKET):
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()
            self.client.init_workload_monitoring()

    def beat(self) -> None:
        if self.client is not None:
            self.client.send_heartbeat()

    def close(self) -> None:
        if self.client is not None:
            self.client.shutdown_workload_monitoring()
            self.client = None
