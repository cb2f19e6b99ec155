"""conftest.py: on a GPU machine `pytest -k cuda` selects the kernels' own test files, which choose CUDA themselves;
the `slow` tests run first."""

from types import SimpleNamespace

import pytest
import torch

from tests.conftest import pytest_collection_modifyitems, runs_on_cuda


class _Item:
    """Stands in for a collected test: its module and its markers."""

    def __init__(self, module, *markers):
        self.module, self.markers = module, list(markers)

    def add_marker(self, marker):
        self.markers.append(marker.name)

    def get_closest_marker(self, name):
        return getattr(pytest.mark, name) if name in self.markers else None


@pytest.mark.parametrize(("module", "expected"), [
    (SimpleNamespace(DEVICE=torch.device("cuda")), True),
    (SimpleNamespace(DEVICE=torch.device("cpu")), False),
    (SimpleNamespace(DEVICE="cuda"), False),  # a string is not the module's device choice
    (SimpleNamespace(), False),
    (None, False),  # items without a Python module (doctests, say)
])
def test_a_module_that_chose_cuda_runs_on_cuda(module, expected):
    assert runs_on_cuda(module) is expected


def test_the_hook_marks_only_the_modules_on_cuda():
    on_gpu, on_cpu = _Item(SimpleNamespace(DEVICE=torch.device("cuda", 0))), _Item(SimpleNamespace())
    pytest_collection_modifyitems(None, [on_gpu, on_cpu])
    assert on_gpu.markers == ["cuda"] and on_cpu.markers == []


def test_slow_tests_go_first_and_the_rest_keep_their_order():
    quick1, slow1, quick2, slow2 = (_Item(None, *mark) for mark in ((), ("slow",), (), ("slow",)))
    items = [quick1, slow1, quick2, slow2]
    pytest_collection_modifyitems(None, items)
    assert items == [slow1, slow2, quick1, quick2]


def test_the_kernel_files_carry_the_mark_where_they_run_on_cuda(request):
    kernel_tests = [item for item in request.session.items if item.path.name == "test_triton_energy.py"]
    if not kernel_tests:
        pytest.skip("collected without tests/ops/test_triton_energy.py")
    marked = {item.get_closest_marker("cuda") is not None for item in kernel_tests}
    assert marked == {torch.cuda.is_available()}
