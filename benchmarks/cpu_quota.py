"""A hard CPU cap for one process: a cgroup with a CFS quota (cgroup v1's cpu controller or v2's cpu.max).

Why a benchmark needs it: on a machine with fewer cores than the processes under test, adding a
second gateway cannot add throughput, because every process already shares the same cores. Capping
each gateway at the same fraction of a core makes the gateways the bottleneck on purpose, so G=2
against G=1 measures what a second gateway adds when each has a core of its own, however few
cores the machine has. It needs root (or a delegated cgroup tree); `CpuQuota.check()` says why not.

The quota is enforced per `period_us` window: with 0.3 cores and a 20 ms period, the process runs
at most 6 ms of every 20 ms (all its threads together), then waits for the next window.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CPU = CGROUP_ROOT / "cpu"


class CpuQuotaError(RuntimeError):
    pass


class CpuQuota:
    """One cgroup named `name` capped at `cores` (a fraction or a multiple of one core). Not thread-safe."""

    def __init__(self, name: str, cores: float, period_us: int = 20_000):
        assert cores > 0, cores  # the caller validates it (bench cluster's --gateway-cpus)
        self.check()
        quota_us = max(1000, round(cores * period_us))
        v1 = (V1_CPU / "cpu.cfs_quota_us").exists()
        self.path = (V1_CPU if v1 else CGROUP_ROOT) / name
        self.path.mkdir(exist_ok=True)
        if v1:
            (self.path / "cpu.cfs_period_us").write_text(str(period_us))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota_us))
        else:
            (self.path / "cpu.max").write_text(f"{quota_us} {period_us}")

    @staticmethod
    def check() -> None:
        """Raise CpuQuotaError naming what is missing when CPU quotas cannot be set here."""
        controllers = CGROUP_ROOT / "cgroup.controllers"
        if (V1_CPU / "cpu.cfs_quota_us").exists():
            target = V1_CPU
        elif controllers.exists() and "cpu" in controllers.read_text().split():
            target = CGROUP_ROOT
            if "cpu" not in (CGROUP_ROOT / "cgroup.subtree_control").read_text().split():
                raise CpuQuotaError(f"the cpu controller is not enabled in {target}/cgroup.subtree_control")
        else:
            raise CpuQuotaError(f"no cgroup cpu controller under {CGROUP_ROOT}")
        if not os.access(target, os.W_OK):
            raise CpuQuotaError(f"{target} is not writable: CPU quotas need root or a delegated cgroup")

    def add(self, pid: int) -> None:
        """Move the process (all its threads, and the children it starts later) into the cgroup."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        """Delete the cgroup; its processes must have exited (or moved out) first."""
        with contextlib.suppress(FileNotFoundError):
            self.path.rmdir()
