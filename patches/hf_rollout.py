"""An ``hf`` rollout backend: verl's server-mode rollout served by a Hugging Face model on CPU.

verl 0.9.1 only wires ``vllm``, ``sglang`` and ``trtllm`` into the server-mode rollout the v1
trainer uses (``RolloutReplicaRegistry`` in ``verl/workers/rollout/replica.py:388-390`` and
``_ROLLOUT_REGISTRY`` in ``verl/workers/rollout/base.py``), and none of them runs on CPU. This
module adds ``actor_rollout_ref.rollout.name=hf``, modelled on ``vLLMReplica`` / ``ServerAdapter``:
``HFReplica`` launches one ``cpu_engine.hf_server.HFServer`` Ray actor per replica, and
``HFServerAdapter``, in each FSDP worker, sends it the full weights after every update.
Registration is lazy (``patches.post_import``) and inert unless a config names ``hf``; it is for
tiny models on CPU (tests, the demo). See patches/README.md, "The ``hf`` backend".
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterable
from typing import Any

import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from cpu_engine.hf_server import BACKEND_NAME, HFServer
from patches.post_import import when_imported

logger = logging.getLogger(__name__)

ADAPTER_FQN = "patches.hf_rollout.HFServerAdapter"


def server_actor_name(replica_rank: int, node_rank: int = 0) -> str:
    """Ray actor name of a replica's server (same scheme as ``vllm_server_<r>_<n>``)."""
    return f"{BACKEND_NAME}_server_{replica_rank}_{node_rank}"


@functools.cache
def _replica_class() -> type:
    """Build ``HFReplica`` (a ``RolloutReplica`` subclass) on first use."""
    from verl.workers.rollout.replica import RolloutReplica  # heavy: verl.workers, not at plugin load

    class HFReplica(RolloutReplica):
        """One ``HFServer`` per replica, pinned to the node of the replica's first worker."""

        async def launch_servers(self) -> None:
            node_id = None
            if self.workers:
                node_id = await self.workers[0].__ray_call__.remote(
                    lambda _self: ray.get_runtime_context().get_node_id()
                )
            options: dict[str, Any] = {"name": server_actor_name(self.replica_rank), "num_cpus": 0}
            options["max_concurrency"] = self.max_concurrency
            if node_id is not None:
                options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
            server = (
                ray.remote(HFServer)
                .options(**options)
                .remote(config=self.config, model_path=self.model_config.path, replica_rank=self.replica_rank)
            )
            await server.set_global_steps.remote(0)
            self.servers = [server]
            self._server_handle = server
            self._server_address = f"{BACKEND_NAME}://replica-{self.replica_rank}"

    return HFReplica


@functools.cache
def _adapter_class() -> type:
    from verl.workers.rollout.base import BaseRollout  # heavy: verl.workers, not at plugin load

    class HFServerAdapter(BaseRollout):
        """Trainer-side handle of the ``hf`` server: forwards weight updates, nothing to sleep."""

        def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1):
            super().__init__(config, model_config, device_mesh)
            rank = int(os.environ.get("RANK", "0"))
            cfg = self.config
            world = cfg.tensor_model_parallel_size * cfg.data_parallel_size * cfg.pipeline_model_parallel_size
            self.replica_rank = rank // world if replica_rank == -1 else replica_rank
            self.is_leader = rank % world == 0
            self._server = None

        async def resume(self, tags: list[str]) -> None:
            return None

        async def release(self) -> None:
            return None

        async def update_weights(
            self,
            weights: Iterable[tuple[str, torch.Tensor]],
            global_steps: int | None = None,
            wire_format: str = "named_tensors",
            **kwargs: Any,
        ) -> None:
            if wire_format != "named_tensors":
                raise NotImplementedError(
                    f"the hf rollout takes wire_format='named_tensors', got {wire_format!r}"
                )
            state = {name: tensor.detach().to("cpu", copy=True) for name, tensor in weights}
            if not self.is_leader:
                return
            if self._server is None:
                self._server = ray.get_actor(server_actor_name(self.replica_rank))
            loaded = await self._server.load_weights.remote(state, global_steps)
            logger.info("hf rollout: %d tensors loaded (global step %s)", loaded, global_steps)

    return HFServerAdapter


def __getattr__(name: str) -> Any:
    """``HFReplica`` / ``HFServerAdapter`` are built lazily: verl's rollout modules are heavy."""
    if name == "HFReplica":
        return _replica_class()
    if name == "HFServerAdapter":
        return _adapter_class()
    raise AttributeError(name)


def _register_replica(replica_module: Any) -> None:
    replica_module.RolloutReplicaRegistry.register(BACKEND_NAME, _replica_class)


def _register_adapter(base_module: Any) -> None:
    base_module._ROLLOUT_REGISTRY.setdefault((BACKEND_NAME, "async"), ADAPTER_FQN)


def install() -> None:
    """Register backend ``hf`` in both rollout registries when (or if already) they are imported."""
    when_imported("verl.workers.rollout.replica", _register_replica)
    when_imported("verl.workers.rollout.base", _register_adapter)
