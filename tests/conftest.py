"""Shared test settings."""

import os

import torch

# Without a GPU, the Triton kernels run (and are checked) in Triton's CPU interpreter; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests run many tiny tensor ops; with two intra-op threads each op pays an OpenMP hand-off that is
# 10-20x its own cost when the other core is busy. One thread keeps the suite fast and its timing steady.
torch.set_num_threads(1)
