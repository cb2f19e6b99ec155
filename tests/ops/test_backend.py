"""backend.py: a kernel that Triton cannot compile or launch on a user's device says how to go on."""

import pytest

from modeling_brillm.backend import launch


class _Kernel:
    """Stands in for a JITFunction whose launch fails as Triton's do on a device it cannot serve."""

    def __init__(self, error):
        self.error = error

        def _scan_forward_kernel():
            pass

        self.fn = _scan_forward_kernel

    def __getitem__(self, grid):
        def run(*args, **kwargs):
            raise self.error

        return run


def test_a_failed_launch_names_the_kernel_and_the_way_around():
    cause = ValueError("triton compilation failed\nout of resource: shared memory, Required: 262144, Hardware limit: "
                       "101376")
    with pytest.raises(RuntimeError) as info:
        launch(_Kernel(cause), (4,), 1, 2, BLOCK=16)
    message = str(info.value)
    assert "Triton kernel _scan_forward_kernel failed (ValueError: out of resource: shared memory" in message
    assert "BRILLM_BACKEND=torch" in message and info.value.__cause__ is cause
    assert launch(type("Ok", (), {"__getitem__": lambda self, grid: lambda *a, **k: grid})(), (2, 3)) == (2, 3)
