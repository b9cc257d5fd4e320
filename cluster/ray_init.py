"""Connecting the driver to Ray: join a cluster when there is one, else start a right-sized local one."""

from __future__ import annotations

import os

from core.config import RayConfig


def connect(cfg: RayConfig) -> str:
    """Initialise Ray once and describe what we joined.

    Inside `ray job submit` (or with RAY_ADDRESS set) we join that cluster and size nothing.
    Otherwise we start a local Ray with a bounded object store: Ray's default of 30% of RAM
    would starve DeepSpeed workers on a 24 GiB machine.
    """
    import ray

    if ray.is_initialized():
        return "already connected"
    quiet = dict(configure_logging=True, logging_level="WARNING", log_to_driver=True)
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], **quiet)
        where = f"joined Ray cluster at {os.environ['RAY_ADDRESS']}"
    else:
        ray.init(num_cpus=cfg.num_cpus or os.cpu_count(),
                 object_store_memory=int(cfg.object_store_gb * (1 << 30)),
                 include_dashboard=cfg.dashboard, dashboard_host="127.0.0.1", **quiet)
        where = "started a local Ray"
        if cfg.dashboard:  # Ray 2.60's dashboard opens on a token dialog; say where the token is
            where += (" (dashboard http://127.0.0.1:8265: Jobs, Train and Tune pages; its token: "
                      "`ray get-auth-token`)")
    res = ray.cluster_resources()
    return f"{where}: {int(res.get('CPU', 0))} CPUs, {int(res.get('GPU', 0))} GPUs, {len(ray.nodes())} node(s)"


def cluster_gpus() -> int:
    import ray

    return int(ray.cluster_resources().get("GPU", 0))


def cluster_cpus() -> int:
    import ray

    return int(ray.cluster_resources().get("CPU", 0))


def nodes_not_seeing(path: str) -> list[str]:
    """The addresses of the live nodes on which `path` (a file this process just wrote) does not exist: a zero-CPU
    task pinned to each node looks for it."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def exists(p: str) -> bool:
        return os.path.exists(p)

    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) < 2:
        return []
    seen = ray.get([exists.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                    .remote(path) for n in nodes])
    return [n["NodeManagerAddress"] for n, ok in zip(nodes, seen) if not ok]
