"""Shared test settings."""

import torch

# The tests run many tiny tensor ops; with two intra-op threads each op pays an OpenMP hand-off that is
# 10-20x its own cost when the other core is busy. One thread keeps the suite fast and its timing steady.
torch.set_num_threads(1)
