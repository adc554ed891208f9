"""Scale-out on Ray: `ReplicaPool`, N engines as Ray actors behind the engine's own async API (docs/ray.md).

Ray is the optional extra `ray`; importing this package does not import it, making a pool does.
"""

from asyncllm.ray.pool import ReplicaPool

__all__ = ["ReplicaPool"]
