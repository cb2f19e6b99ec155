"""Which implementation runs BriLLM's hot paths: torch (every device) or Triton kernels (CUDA tensors, when `triton`
is importable); choose with `BRILLM_BACKEND=auto|torch|triton` or `with kernel_backend("torch"):`. `triton` on CPU
tensors needs Triton's interpreter (`TRITON_INTERPRET=1`), how the kernels are checked without a GPU."""

import contextlib
import functools
import importlib.util
import os

import torch

BACKENDS = ("auto", "torch", "triton")

# CUDA builds of torch ship triton (`brillm[gpu]` elsewhere); looked up, not imported, until a kernel first runs
HAVE_TRITON = importlib.util.find_spec("triton") is not None

_override: str | None = None


def _check(name: str) -> str:
    """The backend name, refused with the choices when it is not one of them."""
    if name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r} "
                         "(BRILLM_BACKEND or kernel_backend()).")
    return name


def current_backend() -> str:
    """The requested backend: `kernel_backend(...)` if active, else $BRILLM_BACKEND, else "auto"."""
    return _check(_override if _override is not None else os.environ.get("BRILLM_BACKEND", "auto"))


@contextlib.contextmanager
def kernel_backend(name: str):
    """Run the enclosed code with backend `name` ("auto", "torch" or "triton")."""
    global _override
    previous, _override = _override, _check(name)
    try:
        yield
    finally:
        _override = previous


def interpreting() -> bool:
    """True when Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(tensor) -> bool:
    """Whether the hot path for `tensor` (its device decides) runs the Triton kernels."""
    choice = current_backend()
    if choice == "torch":
        return False
    if choice == "auto":
        return HAVE_TRITON and tensor.is_cuda
    if not HAVE_TRITON:
        raise RuntimeError("BRILLM_BACKEND=triton but triton is not installed: pip install triton (or brillm[gpu]), "
                           "or use BRILLM_BACKEND=auto.")
    if not tensor.is_cuda and not interpreting():
        raise RuntimeError("BRILLM_BACKEND=triton on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                           "before importing triton, or move the model to a GPU.")
    return True


def triton_modules():
    """(triton, triton.language), or (None, None) where triton is missing: the kernel modules' one import of it."""
    try:  # transformers' check of a saved model's imports skips try blocks: a CPU-only install never needs triton
        import triton
        import triton.language as tl
    except ImportError:  # pragma: no cover - found by find_spec but broken
        return None, None
    return triton, tl


def launch(kernel, grid, *args, **kwargs):
    """`kernel[grid](*args, **kwargs)`; where Triton fails to compile or launch it, one error that says how to go on."""
    try:
        return kernel[grid](*args, **kwargs)
    except Exception as error:
        name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
        detail = str(error).strip().splitlines()
        raise RuntimeError(
            f"BriLLM's Triton kernel {name} failed ({type(error).__name__}: {detail[-1] if detail else ''}). Set "
            "BRILLM_BACKEND=torch (or `with kernel_backend('torch'):`) to run the torch path instead, and please "
            "report it with your GPU, torch and triton versions.") from error


def package_tool(module: str, feature: str):
    """`modeling_brillm.<module>`, for a model method that is a tool of the package (not in saved code)."""
    try:
        return importlib.import_module(f"modeling_brillm.{module}")
    except ImportError:
        raise ImportError(f"model.{feature} is a tool of the brillm package, which a saved model's code does not "
                          "carry: pip install brillm (or pip install -e . in the repository).") from None


AUTOCAST_DEVICES = tuple(kind for kind in ("cpu", "cuda", "xpu", "mps") if torch.amp.is_autocast_available(kind))


def exact_precision(forward):
    """Run `forward` with autocast off: autocast would cast each gathered edge row again at every use and, on the Triton
    path, put a 16-bit shared energy beside float32 ones in every softmax (docs/gpu.md, "Mixed precision")."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        if any(torch.is_autocast_enabled(kind) for kind in AUTOCAST_DEVICES):  # cheap, unlike the parameters' device
            device_type = next(self.parameters()).device.type
            if device_type in AUTOCAST_DEVICES and torch.is_autocast_enabled(device_type):
                with torch.autocast(device_type, enabled=False):
                    return forward(self, *args, **kwargs)
        return forward(self, *args, **kwargs)

    return wrapper

