"""The multi-node rank contract: what the operator sets on every pod of a replica, parsed once.

Every pod of a replica runs the same `stallfree serve ... --tensor-parallel-size T --pipeline-parallel-size P`
command. The environment says which part it plays:

  STALLFREE_NUM_NODES       pods in the replica (default 1). T * P must be a multiple of it.
  STALLFREE_NODE_RANK       this pod's index, 0 .. NUM_NODES - 1 (default 0). Pod 0 is the leader: it
                            serves HTTP, runs the scheduler and sends every micro-batch to every rank.
  STALLFREE_LEADER_ADDRESS  host name of pod 0 (default 127.0.0.1).
  MASTER_ADDR, MASTER_PORT  torch.distributed rendezvous (default: the leader address, 29500).
  STALLFREE_CONTROL_PORT    the leader's control port that workers connect to (default MASTER_PORT + 1).
  STALLFREE_PARALLEL_AUTHKEY  shared secret of the control connections (default: STALLFREE_ADMIN_TOKEN,
                            which the operator sets on every pod from its Secret; else a fixed string, fine
                            only on one host).

Ranks: node n runs the ranks_per_node = T * P / NUM_NODES ranks n * ranks_per_node ...; rank r is tensor rank
r % T of pipeline stage r // T, so a stage's tensor-parallel group stays inside one node when T <= ranks
per node. On CUDA a rank uses device cuda:(r % ranks_per_node).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_DIST_PORT = 29500
_FALLBACK_AUTHKEY = "stallfree-local"


@dataclass(frozen=True, slots=True)
class NodeContract:
    num_nodes: int
    node_rank: int
    leader_address: str
    master_addr: str
    master_port: int
    control_port: int
    authkey: bytes

    @property
    def is_leader(self) -> bool:
        return self.node_rank == 0

    def ranks(self, world_size: int) -> range:
        """The global ranks this node runs."""
        per = self.ranks_per_node(world_size)
        return range(self.node_rank * per, (self.node_rank + 1) * per)

    def ranks_per_node(self, world_size: int) -> int:
        if world_size % self.num_nodes:
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {world_size} ranks cannot be spread evenly "
                f"over STALLFREE_NUM_NODES={self.num_nodes} pods"
            )
        return world_size // self.num_nodes

    @property
    def init_method(self) -> str:
        return f"tcp://{self.master_addr}:{self.master_port}"


def _int(env: Mapping[str, str], name: str, default: int, lo: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < lo:
        raise ValueError(f"{name}={value} must be >= {lo}")
    return value


def read_contract(env: Mapping[str, str] | None = None) -> NodeContract:
    """Parse the rank contract from `env` (default os.environ). Raises ValueError naming the bad variable."""
    env = os.environ if env is None else env
    num_nodes = _int(env, "STALLFREE_NUM_NODES", 1, 1)
    node_rank = _int(env, "STALLFREE_NODE_RANK", 0, 0)
    if node_rank >= num_nodes:
        raise ValueError(f"STALLFREE_NODE_RANK={node_rank} must be below STALLFREE_NUM_NODES={num_nodes}")
    leader = env.get("STALLFREE_LEADER_ADDRESS") or "127.0.0.1"
    master_addr = env.get("MASTER_ADDR") or leader
    master_port = _int(env, "MASTER_PORT", DEFAULT_DIST_PORT, 1)
    control_port = _int(env, "STALLFREE_CONTROL_PORT", master_port + 1, 1)
    if master_port > 65535 or control_port > 65535:
        raise ValueError(f"ports must be below 65536: MASTER_PORT={master_port}, control port={control_port}")
    key = env.get("STALLFREE_PARALLEL_AUTHKEY") or env.get("STALLFREE_ADMIN_TOKEN") or _FALLBACK_AUTHKEY
    if num_nodes > 1 and key == _FALLBACK_AUTHKEY:
        raise ValueError(
            "several nodes need a shared secret for the control connections: set STALLFREE_PARALLEL_AUTHKEY "
            "(or STALLFREE_ADMIN_TOKEN) to the same value on every pod"
        )
    return NodeContract(num_nodes, node_rank, leader, master_addr, master_port, control_port, key.encode())
