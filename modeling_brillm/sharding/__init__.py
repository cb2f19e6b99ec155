"""Source-sharded training: each process owns the edge blocks of a set of source nodes (like expert parallelism).

A process keeps the CSR blocks of the sources it owns (`owners`), plus the shared edge (row 0), and the AdamW state
of those rows only; every other parameter is small and replicated. A step: (1) each process runs the model's own
recurrence over its own sequences, the edge rows it crosses fetched from their owners (`table`, `transport`);
(2) each scored position's signal goes to the owner of its source, which scores it with the model's own code
(`model`); (3) `reduce_gradients()` all-reduces the replicated gradients, `clip_grad_norm_()` clips by the global
norm, and each owner updates its touched rows with lazy AdamW (`gradients`): the table's gradient never crosses
the network. Checkpoints resume on any process count (`checkpoint`). The same global batch gives one process's
losses and parameters (with `SparseAdamW`), to float rounding. A custom loop: docs/training.md, "Edge sharding".
"""

from .checkpoint import SHARD_PATTERN, SHARED_FILE
from .model import ShardedBriLLM, ShardedOutput
from .owners import balance_sources, check_assignment, sharded_memory, source_costs

__all__ = ["ShardedBriLLM", "ShardedOutput", "balance_sources", "source_costs", "check_assignment", "sharded_memory",
           "SHARED_FILE", "SHARD_PATTERN"]
