"""The Ray cluster of a `placement.backend: ray` run: joining one (or starting a local one) and
the placement group that holds a bundle per trainer rank and per engine.

Bundles come in a fixed order: `placement.trainer_ranks` trainer bundles first, then
`placement.num_engines` engine bundles (with `placement.engines: processes`; other engines
run in trainer rank 0's process), so trainer rank r is bundle r and engine i is bundle
`trainer_ranks + i`. A bundle asks for its CPUs, its GPUs (one per trainer rank and per engine
on a cluster with GPUs, unless set) and the custom resources of `placement.ray_*_resources`,
which is how engines and trainer ranks are pinned to nodes of their own. Before anything is
placed, every bundle is checked against the nodes' resources, and a request no node (or not
the whole cluster) can meet is refused naming the fields.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

from verst.fleet.placement import PlacementConfig

PLACEMENT_GROUP_ENV = "VERST_RAY_PLACEMENT_GROUP"  # set in trainer ranks placed by Ray
NAMESPACE = "verst"  # named placement groups are found within one namespace


def require_ray() -> Any:
    """The `ray` module, or an error saying how to get it."""
    if importlib.util.find_spec("ray") is None:
        raise RuntimeError(
            "placement.backend=ray needs Ray, which is not installed: pip install 'verst[ray]' "
            "(or set placement.backend=local)"
        )
    import ray

    return ray


@dataclass
class RayCluster:
    """This process's connection to a Ray cluster; `local` is the cluster it started, if any."""

    address: str
    start_s: float  # seconds from connecting to a cluster ready to place bundles
    local: Any = None  # ray.cluster_utils.Cluster

    def shutdown(self) -> None:
        ray = require_ray()
        ray.shutdown()
        if self.local is not None:
            self.local.shutdown()


def connect(cfg: PlacementConfig) -> RayCluster:
    """Join `placement.ray_address` (else $RAY_ADDRESS), or start a local cluster of
    `placement.ray_local_nodes` and join it."""
    ray = require_ray()
    began = time.monotonic()
    address = cfg.ray_address or os.environ.get("RAY_ADDRESS")
    if address:
        field = "placement.ray_address" if cfg.ray_address else "$RAY_ADDRESS"
        check_reachable(address, field, cfg.ray_connect_timeout_s)
        ray.init(address=address, namespace=NAMESPACE)
        return RayCluster(ray.get_runtime_context().gcs_address, time.monotonic() - began)
    from ray.cluster_utils import Cluster

    nodes = cfg.ray_local_nodes or [None]
    store = cfg.ray_object_store_mb * 1024 * 1024
    local = Cluster()
    try:
        for node in nodes:
            args: dict[str, Any] = {"object_store_memory": store, "include_dashboard": False}
            if node is not None:
                args |= {"num_cpus": node.num_cpus, "num_gpus": node.num_gpus}
                args["resources"] = dict(node.resources)
            local.add_node(**args)
        local.wait_for_nodes()
        ray.init(address=local.address, namespace=NAMESPACE)
    except BaseException:
        local.shutdown()
        raise
    return RayCluster(local.address, time.monotonic() - began, local)


def check_reachable(address: str, field: str, timeout_s: float) -> None:
    """Refuse a cluster address where nothing listens: `ray.init` would retry it for minutes
    (it logs GCS time-outs and never gives up), so the run would hang instead of failing."""
    if address in ("auto", "local"):
        return  # Ray resolves these itself, and fails at once when no cluster runs here
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"{field}={address!r}: a Ray cluster address is HOST:PORT (or 'auto')")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as error:
        raise ValueError(
            f"{field}={address}: no Ray cluster answers there ({error}); start one with "
            "`ray start --head --port=PORT`, fix the address, or unset it (and "
            "placement.ray_address) to start a local cluster"
        ) from None


def join_from_rank() -> Any:
    """In a trainer rank placed by Ray: join its cluster ($RAY_ADDRESS, set by the driver) and
    return the run's placement group."""
    ray = require_ray()
    from ray.util import get_placement_group

    if not ray.is_initialized():
        # the rank's console is its actor's, which the driver already shows
        ray.init(address=os.environ["RAY_ADDRESS"], namespace=NAMESPACE, log_to_driver=False)
    return get_placement_group(os.environ[PLACEMENT_GROUP_ENV])


def _gpus(setting: float | None, cluster_gpus: float) -> float:
    if setting is not None:
        return int(setting) if setting == int(setting) else setting
    return 1 if cluster_gpus > 0 else 0


def bundles(cfg: PlacementConfig, cluster_gpus: float) -> list[dict[str, float]]:
    """The trainer ranks' bundles, then the engines'."""
    trainer = {"CPU": cfg.ray_trainer_cpus, "GPU": _gpus(cfg.ray_trainer_gpus, cluster_gpus)}
    engine = {"CPU": cfg.ray_engine_cpus, "GPU": _gpus(cfg.ray_engine_gpus, cluster_gpus)}
    trainer |= cfg.ray_trainer_resources
    engine |= cfg.ray_engine_resources
    strip = [{k: v for k, v in b.items() if v} for b in (trainer, engine)]
    engines = cfg.num_engines if cfg.engines == "processes" else 0  # others run in rank 0
    return [strip[0]] * cfg.trainer_ranks + [strip[1]] * engines


def _fields(index: int, cfg: PlacementConfig) -> str:
    role = "trainer" if index < cfg.trainer_ranks else "engine"
    return f"placement.ray_{role}_cpus / ray_{role}_gpus / ray_{role}_resources"


def check_resources(
    wanted: list[dict[str, float]], nodes: list[dict[str, float]], cfg: PlacementConfig
) -> None:
    """Refuse bundles that no node can hold, or that the cluster cannot hold together."""
    for index, bundle in enumerate(wanted):
        if not any(all(node.get(k, 0) >= v for k, v in bundle.items()) for node in nodes):
            raise ValueError(
                f"{_fields(index, cfg)}: bundle {index} asks for {bundle}, which no node of the "
                f"Ray cluster offers (nodes: {nodes})"
            )
    total: dict[str, float] = {}
    for bundle in wanted:
        for key, value in bundle.items():
            total[key] = total.get(key, 0) + value
    offered = {k: sum(node.get(k, 0) for node in nodes) for k in total}
    short = {k: (v, offered[k]) for k, v in total.items() if v > offered[k]}
    if short:
        raise ValueError(
            f"placement.trainer_ranks={cfg.trainer_ranks} and placement.num_engines="
            f"{cfg.num_engines} need {total} in all, more than the Ray cluster offers "
            f"({', '.join(f'{k}: {w} wanted, {o} offered' for k, (w, o) in short.items())})"
        )


def node_resources() -> list[dict[str, float]]:
    """The resources of every live node (their totals, as Ray counts them)."""
    ray = require_ray()
    return [dict(node["Resources"]) for node in ray.nodes() if node["Alive"]]


def place(cfg: PlacementConfig, name: str) -> Any:
    """The run's placement group, named `name` (how trainer ranks find it), placed (or an
    error naming what could not be)."""
    ray = require_ray()
    from ray.util import placement_group, remove_placement_group

    nodes = node_resources()
    wanted = bundles(cfg, sum(node.get("GPU", 0) for node in nodes))
    check_resources(wanted, nodes, cfg)
    group = placement_group(wanted, strategy="PACK", name=name)
    ready, _ = ray.wait([group.ready()], timeout=cfg.ray_placement_timeout_s)
    if not ready:
        remove_placement_group(group)
        raise RuntimeError(
            f"placement.ray_placement_timeout_s: the Ray cluster did not place the bundles "
            f"{wanted} within {cfg.ray_placement_timeout_s:.0f} s (other jobs may hold them)"
        )
    return group


def scheduling(group: Any, bundle_index: int) -> Any:
    """The scheduling strategy that puts an actor in bundle `bundle_index` of `group`."""
    require_ray()
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    return PlacementGroupSchedulingStrategy(
        placement_group=group, placement_group_bundle_index=bundle_index
    )


def bundle_nodes(group: Any) -> list[str]:
    """The node id of each bundle of a placed group, in bundle order."""
    require_ray()
    from ray.util import placement_group_table

    by_index = placement_group_table(group)["bundles_to_node_id"]
    return [by_index[i] for i in sorted(by_index)]
