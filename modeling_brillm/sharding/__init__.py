"""Source-sharded training: each process owns the edge blocks of a set of source nodes (like expert parallelism).

A process keeps the CSR blocks of the sources it owns (`owners`) and their AdamW state; every other parameter is
small and replicated. In a step each process runs the model's own recurrence over its sequences, fetching the edge
rows it crosses from their owners (`table`, `transport`), and sends each scored position's signal to the owner of
its source, which scores it with the model's own code (`model`); the replicated gradients are all-reduced, the
table's never cross the network (`gradients`). Checkpoints resume on any process count (`checkpoint`). The same
global batch gives one process's losses and parameters to float rounding. A custom loop: docs/training.md.
"""

from .checkpoint import SHARD_PATTERN, SHARED_FILE
from .model import ShardedBriLLM, ShardedOutput
from .owners import balance_sources, check_assignment, sharded_memory, source_costs

__all__ = ["ShardedBriLLM", "ShardedOutput", "balance_sources", "source_costs", "check_assignment", "sharded_memory",
           "SHARED_FILE", "SHARD_PATTERN"]
