"""Source-sharded training: each process owns the edge blocks of a set of source nodes (like expert parallelism),
every other parameter replicated (docs/training.md, "Edge sharding")."""

from .checkpoint import SHARD_PATTERN, SHARED_FILE
from .model import ShardedBriLLM, ShardedOutput
from .table import balance_sources, check_assignment, sharded_memory, source_costs

__all__ = ["ShardedBriLLM", "ShardedOutput", "balance_sources", "source_costs", "check_assignment", "sharded_memory",
           "SHARED_FILE", "SHARD_PATTERN"]
