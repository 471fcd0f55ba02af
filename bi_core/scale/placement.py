"""Where the replicas run: a Ray placement group with one bundle per replica (its tensor-parallel
GPUs and one CPU; CPU only when the engine runs on CPUs), and one actor per bundle
(``replica.ReplicaProcess``). Bundles are packed (a replica's GPUs are always on one node; PACK
fills a node before the next)."""

from __future__ import annotations

import logging
from pathlib import Path

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from bi_core.config import EngineConfig, _read_yaml
from bi_core.errors import BiEngineError
from bi_core.scale.replica import ReplicaProcess

log = logging.getLogger("bi_core.scale")
NAMESPACE = "bi-engine"
CPUS_PER_REPLICA = 1  # the actor; the server's processes use the node's cores as a lone server would


def connect(address: str | None) -> None:
    """Join the Ray cluster at ``address`` (``auto``, ``ray://host:10001``, ...); None: RAY_ADDRESS,
    else start a Ray instance on this machine."""
    try:
        ray.init(address=address, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        raise BiEngineError(f"--ray-address {address}: cannot join the Ray cluster: {e}") from None


def gpus_per_replica(config: EngineConfig, cluster: dict) -> int:
    """The GPUs a replica's bundle holds: its tensor-parallel size on a CUDA device, 0 on CPUs
    (device auto: CUDA when the cluster has GPUs)."""
    device, tp = config.model.device, config.parallel.tensor_parallel_size
    if device.startswith("cuda:"):
        raise BiEngineError(f"model.device: {device} names one GPU, but with data_parallel_size > 1 Ray assigns "
                            "each replica its GPUs; use cuda (or auto)")
    if device == "cpu" or (device == "auto" and not cluster.get("GPU")):
        return 0
    return tp


def bundles(config: EngineConfig, num_replicas: int, cluster: dict) -> list[dict]:
    """One bundle per replica; an error naming what the cluster lacks when it cannot hold them."""
    gpus = gpus_per_replica(config, cluster)
    bundle = {"CPU": CPUS_PER_REPLICA, **({"GPU": gpus} if gpus else {})}
    for resource, each in bundle.items():
        have = cluster.get(resource, 0)
        if each * num_replicas > have:
            raise BiEngineError(f"parallel.data_parallel_size: {num_replicas} replicas need {each * num_replicas:g} "
                                f"{resource} ({each:g} each{' = tensor_parallel_size' if resource == 'GPU' else ''}); "
                                f"the Ray cluster has {have:g}")
    return [dict(bundle) for _ in range(num_replicas)]


def place(config: EngineConfig, num_replicas: int, timeout_s: float) -> PlacementGroup:
    group = placement_group(bundles(config, num_replicas, ray.cluster_resources()), strategy="PACK",
                            name="bi-engine-replicas")
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise BiEngineError(f"Ray could not place {num_replicas} replicas ({group.bundle_specs[0]} each) within "
                            f"{timeout_s:g} s: the cluster's free resources are {ray.available_resources()}") from None
    return group


def replica_config(path: str, config: EngineConfig) -> dict:
    """The config every replica runs: the YAML as written (so each replica parses it as a lone server
    would), with one replica, the mode the driver resolved (flags, environment) and absolute paths."""
    data = _read_yaml(Path(path))
    data.setdefault("parallel", {})["data_parallel_size"] = 1
    data.setdefault("policy", {})["batch_invariant"] = config.policy.batch_invariant
    for section, key in (("model", "path"), ("model", "tokenizer"), ("strategy", "draft_vocab")):
        value = (data.get(section) or {}).get(key)
        if value is not None:
            data[section][key] = str(Path(value).resolve())
    return data


def spawn(group: PlacementGroup, index: int, config: dict, api_key: str | None):
    """The actor of replica ``index``, in bundle ``index``."""
    bundle = group.bundle_specs[index]
    actor = ray.remote(ReplicaProcess).options(
        num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0),
        scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index))
    return actor.remote(index, config, api_key)
