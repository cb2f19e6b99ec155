"""Shared test settings, and the `device` fixture: the CPU, plus CUDA when a GPU is present."""

import os

import pytest
import torch

# Without a GPU, the Triton kernels run (and are checked) in Triton's CPU interpreter; it must be chosen before
# triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests run many tiny tensor ops; with two intra-op threads each op pays an OpenMP hand-off that is
# 10-20x its own cost when the other core is busy. One thread keeps the suite fast and its timing steady.
torch.set_num_threads(1)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session", params=DEVICES)
def device(request) -> torch.device:
    """Where a tensor-touching test puts its model. Every such test runs once per entry of DEVICES, so `make test`
    on a GPU machine exercises the CUDA paths (Triton kernels included) and a CPU-only run has no extra skips.
    Tests leave their small inputs on the CPU where they can: the model moves its inputs to its own device."""
    return torch.device(request.param)


def pytest_collection_modifyitems(config, items):
    """Mark `cuda` every test whose module runs on a GPU by itself (the kernels' own files set a module-level
    `DEVICE` rather than take the `device` fixture), so `pytest -k cuda` on a GPU machine selects them too.

    Then run the `slow` tests (whole training runs, several processes) first: pytest-xdist hands tests out in
    this order, and the long ones last in the queue would leave one worker finishing them alone."""
    for item in items:
        if runs_on_cuda(getattr(item, "module", None)):  # non-Python items (a plugin's) have none
            item.add_marker(pytest.mark.cuda)
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the rest keep their order


def runs_on_cuda(module) -> bool:
    """A test module that picks its device itself, and picked CUDA."""
    device = getattr(module, "DEVICE", None)
    return isinstance(device, torch.device) and device.type == "cuda"
