"""The kernel self-check (selfcheck.run_self_check, `python -m modeling_brillm.selfcheck`): every kernel passes it here
(Triton's interpreter on CPU tensors without a GPU), and a kernel that fails it, by raising or by returning wrong
numbers, is switched off alone, with one warning, after which the results are the torch path's."""

import warnings

import pytest
import torch

from modeling_brillm import ops, optimization, selfcheck
from modeling_brillm.backend import kernel_backend
from modeling_brillm.plans import CandidatePlan, KernelPlan
from modeling_brillm.state import Columns, Mix
from modeling_brillm.tables import EdgeTable

pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def fresh_check(monkeypatch):
    """Every test starts unchecked, with the automatic check on for this device type too (the interpreter's)."""
    monkeypatch.setattr(ops, "CHECK_DEVICE_TYPES", {DEVICE.type})
    monkeypatch.delenv("BRILLM_SELF_CHECK", raising=False)
    ops.reset_self_check()
    yield
    ops.reset_self_check()


def test_every_kernel_passes_its_check():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        results = selfcheck.run_self_check(DEVICE)
    assert [r.name for r in results] == list(selfcheck.KERNELS)
    for r in results:
        assert r.ok and r.failure is None and r.error <= selfcheck.TOLERANCE, r
    assert ops.disabled_kernels(DEVICE) == {}


def _raise(*args, **kwargs):
    raise RuntimeError("simulated: the kernel does not compile on this device")


def _scan_inputs():
    g = torch.Generator().manual_seed(0)
    B, L, P, d = 2, 4, 6, 8
    signal = torch.randn(B, d, generator=g)
    state = (signal, signal.clone(), torch.ones(B), torch.zeros(B))
    tables = (torch.randn(P, d, d, generator=g) * 0.5, torch.randn(P, 1, d, generator=g))
    rows = torch.randint(0, P, (B, L), generator=g)
    state, mix_weight, tables, rows = [t.to(DEVICE) for t in state], torch.randn(B, L, generator=g).to(DEVICE), \
        [t.to(DEVICE) for t in tables], rows.to(DEVICE)
    columns = Columns(rows, torch.ones(B, L, dtype=torch.bool, device=DEVICE),
                      torch.randn(B, L, d, generator=g).to(DEVICE), mix_weight)
    return Mix(*state), columns, EdgeTable(*tables)


def _outputs(result):
    signals, mix = result
    return [signals, *mix.tensors()]


@pytest.mark.parametrize("failure", ["raises", "wrong numbers"])
def test_a_failing_scan_is_switched_off_alone(monkeypatch, failure):
    kernel = ops.kernel_signal_scan
    if failure == "raises":
        monkeypatch.setattr(ops, "kernel_signal_scan", _raise)
    else:  # 1% off: beyond the tolerance
        def wrong(*a, **k):
            signals, mix = kernel(*a, **k)
            return signals * 1.01, Mix(*(t * 1.01 for t in mix.tensors()))

        monkeypatch.setattr(ops, "kernel_signal_scan", wrong)
    inputs = _scan_inputs()
    with kernel_backend("triton"):
        with pytest.warns(RuntimeWarning, match="signal_scan is switched off") as caught:
            got = _outputs(ops.signal_scan(*inputs))  # the first kernel call on the device runs the check
        assert len(caught) == 1
        message = str(caught[0].message)
        assert "python -m modeling_brillm.selfcheck" in message and "BRILLM_BACKEND=torch" in message
        assert ("simulated" in message) == (failure == "raises")
        assert set(ops.disabled_kernels(DEVICE)) == {"signal_scan"}
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once: no second warning
            again = _outputs(ops.signal_scan(*inputs))
            assert isinstance(ops.make_plan(torch.tensor([0], device=DEVICE), torch.tensor([0, 1], device=DEVICE),
                                            torch.tensor([0], device=DEVICE), 1), KernelPlan)  # the others stay on
    with kernel_backend("torch"):
        expected = _outputs(ops.signal_scan(*inputs))
    for a, b, c in zip(got, again, expected):
        assert torch.equal(a, c) and torch.equal(b, c)


def test_a_failing_energy_kernel_switches_the_plans_to_torch(monkeypatch):
    monkeypatch.setattr(ops, "kernel_log_partition", _raise)
    sources, indptr, indices = (torch.tensor(v, device=DEVICE) for v in ([0, 1, 0], [0, 2, 3, 3], [1, 2, 0]))
    with kernel_backend("triton"), pytest.warns(RuntimeWarning, match="candidate_energies is switched off"):
        plan = ops.make_plan(sources, indptr, indices, 3)
    assert isinstance(plan, CandidatePlan)
    assert set(ops.disabled_kernels(DEVICE)) == {"candidate_energies"}


def test_a_failing_optimizer_kernel_leaves_the_torch_update(monkeypatch):
    kernel = optimization.kernel_adamw_rows

    def wrong(param, *args, **kwargs):
        kernel(param, *args, **kwargs)
        param.add_(1e-3)

    monkeypatch.setattr(optimization, "kernel_adamw_rows", wrong)
    start = torch.randn(6, 4, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    rows, values = torch.tensor([4, 1, 4], device=DEVICE), torch.randn(3, 4, device=DEVICE)
    results = []
    for backend in ("triton", "torch"):
        state = [start.clone(), torch.zeros_like(start), torch.zeros_like(start)]
        with kernel_backend(backend), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimization.adamw_rows(*state, rows, values, torch.tensor(1.0), (0.1, 0.9, 0.999, 1e-8, 0.0))
        results.append((state, [str(w.message) for w in caught]))
    (got, messages), (expected, _) = results
    assert len(messages) == 1 and "adamw_rows is switched off" in messages[0]
    assert set(ops.disabled_kernels(DEVICE)) == {"adamw_rows"}
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_the_command_line_report(capsys, monkeypatch):
    assert selfcheck.main(["--device", str(DEVICE)]) == 0
    out = capsys.readouterr().out
    for name in selfcheck.KERNELS:
        assert f"{name} " in out
    assert out.count(" ok, max relative error") == len(selfcheck.KERNELS) and "triton" in out

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with kernel_backend("auto"):
        assert selfcheck.main([]) == 0
    assert "No CUDA GPU found" in capsys.readouterr().out
