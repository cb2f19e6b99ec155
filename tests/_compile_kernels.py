"""Compile every Triton kernel for an H100 (sm_90) without a GPU, and print their resources.

    python tests/_compile_kernels.py              # one line per kernel variant: registers, stack (spills), shared
    python tests/_compile_kernels.py --arch 80    # another GPU: 75 T4, 80 A100, 89 L40/RTX 4090, 100 B200,
                                                  # 120 RTX 5090, gfx942 AMD MI300 (compiled only, no registers)

Triton's interpreter (how CI checks the kernels' arithmetic) accepts programs its compiler rejects, and says
nothing about register pressure; the triton wheel ships ptxas, so the real compilation runs on any machine. Must
run without TRITON_INTERPRET (the kernels are then ordinary JIT functions); exits 1 if a variant fails to compile.
The first variant of each kernel and every optimizer variant compile a second time with their int arguments fixed
at 1, as Triton's launcher passes such a value (a constant: the optimizer's first step once failed to compile so).
Variants: the recurrence at the paper's d = 32, the tests' d = 8, d = 64 and the largest supported d = 128, and at
d = 32 with the edges' shared matrix (config.edge_backoff); the optimizer's two row widths (an edge matrix, 1,024
floats; a bias, 32) with and without duplicate rows, and with bfloat16 moments; the decode step's successors
kernel; the
candidate energies' forward (log Z, logits, bf16 rows) and backward (sparse and dense gradients, PE's gradient, the
logits' gradient) at d = 32.
"""

import os
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from modeling_brillm import triton_optim, triton_recurrence  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
TOOLS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def resources(fn, types: dict, constants: dict, num_warps: int) -> str:
    names = fn.arg_names
    signature = {a: types.get(a, "constexpr") for a in names}
    # torch's allocations are 16-byte aligned: Triton assumes it at launch, so the check does too
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(names) if types.get(a, "").startswith("*")}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs), target=TARGET,
                            options=dict(num_warps=num_warps))
    if TARGET.backend == "hip":  # AMD: compiled; no resource dump without the ROCm tools
        return f"compiled (hip {TARGET.arch}), shared {kernel.metadata.shared} bytes"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([os.path.join(TOOLS, "cuobjdump"), "--dump-resource-usage", f.name],
                             capture_output=True, text=True, check=True).stdout
    return next(line.strip() for line in out.splitlines() if "REG:" in line)


def variants():
    R, Opt = triton_recurrence, triton_optim
    forward = {a: "*fp32" for a in R._scan_forward_kernel.arg_names if a.endswith("_ptr")}
    forward.update(rows_ptr="*i64", edge_ptr="*u8", L="i32")
    backward = {a: "*fp32" for a in R._scan_backward_kernel.arg_names if a.endswith("_ptr")}
    backward.update(rows_ptr="*i64", slot_ptr="*i64", edge_ptr="*u8", L="i32")
    for d in (32, 8, 64, 128):
        meta = R._meta(d)
        yield (f"scan forward d={d}", R._scan_forward_kernel, forward, dict(d=d, D=meta["D"], SAVE=True,
               HAS_BASE=False, HAS_DROP=False, HAS_NODE=False), meta)
        yield (f"scan backward d={d}", R._scan_backward_kernel, backward, dict(d=d, D=meta["D"], NEED_W=True,
               NEED_B=True, HAS_BASE=False, NEED_BASE=False, HAS_DROP=False, HAS_NODE=False), meta)
    yield ("scan forward d=32 shared matrix", R._scan_forward_kernel, forward,
           dict(d=32, D=32, SAVE=True, HAS_BASE=True, HAS_DROP=False, HAS_NODE=False), R._meta(32))
    yield ("scan backward d=32 shared matrix", R._scan_backward_kernel, backward,
           dict(d=32, D=32, NEED_W=True, NEED_B=True, HAS_BASE=True, NEED_BASE=True, HAS_DROP=False, HAS_NODE=False),
           R._meta(32))
    for drop in (False, True):  # the default recipe: the shared matrix and the nodes' vectors, with or without dropout
        yield (f"scan forward d=32 shared matrix, node vectors, dropout={drop}", R._scan_forward_kernel, forward,
               dict(d=32, D=32, SAVE=True, HAS_BASE=True, HAS_DROP=drop, HAS_NODE=True), R._meta(32))
        yield (f"scan backward d=32 shared matrix, node vectors, dropout={drop}", R._scan_backward_kernel, backward,
               dict(d=32, D=32, NEED_W=True, NEED_B=True, HAS_BASE=True, NEED_BASE=True, HAS_DROP=drop,
                    HAS_NODE=True), R._meta(32))
    yield ("scan forward d=32 bf16 weights", R._scan_forward_kernel, dict(forward, w_ptr="*bf16", b_ptr="*bf16",
           pe_ptr="*bf16"), dict(d=32, D=32, SAVE=False, HAS_BASE=False, HAS_DROP=False, HAS_NODE=False),
           R._meta(32))
    optim = {a: "*fp32" for a in Opt._sparse_adamw_kernel.arg_names if a.endswith("_ptr")}
    optim.update(rows_ptr="*i64", entries_ptr="*i64", nnz="i32")
    optim.update({a: "fp32" for a in ("lr", "beta1", "beta2", "eps", "decay", "step_size", "bc2_sqrt", "log_beta1",
                                      "log_beta2", "first_row_scale")})
    optim.update(step_host="i32")
    for width in (1024, 32):
        block_w = min(triton.next_power_of_2(width), Opt._TILE)
        for unique in (True, False):
            yield (f"sparse adamw width={width} unique={unique}", Opt._sparse_adamw_kernel, optim,
                   dict(W=width, HAS_ENTRIES=not unique, UNIQUE=unique, STEP_ON_DEVICE=not unique, ROUNDED=False,
                        BLOCK_R=max(1, Opt._TILE // block_w), BLOCK_W=block_w), dict(num_warps=4))
    for on_device in (False, True):
        yield (f"sparse adamw width=1024 bf16 moments, step {'in kernel' if on_device else 'from host'}",
               Opt._sparse_adamw_kernel, dict(optim, m_ptr="*bf16", v_ptr="*bf16"),
               dict(W=1024, HAS_ENTRIES=False, UNIQUE=True, STEP_ON_DEVICE=on_device, ROUNDED=True, BLOCK_R=2,
                    BLOCK_W=1024), dict(num_warps=4))
    from modeling_brillm import triton_energy as E

    successors = {a: "*fp32" for a in E._decode_successors_kernel.arg_names if a.endswith("_ptr")}
    successors.update(sources_ptr="*i64", indptr_ptr="*i64", indices_ptr="*i64", d="i32", V="i32")
    yield ("decode successors d=32", E._decode_successors_kernel, successors,
           dict(D=32, BN=E.BLOCK_SUCCESSORS, NSUB=E.DECODE_TILE_SUCCESSORS // E.BLOCK_SUCCESSORS, HAS_INDICES=True),
           dict(num_warps=4))

    # candidate energies at the paper's d = 32 on an H100's persistent grid (132 SMs), as energy.py launches them
    tiles = dict(D=32, BM=E.BLOCK_POSITIONS, BN=E.BLOCK_SUCCESSORS, NSUB=32 // E.BLOCK_SUCCESSORS,
                 GRID=132 * E.PROGRAMS_PER_SM, HAS_INDICES=True, PRECISION=E.DOT_PRECISION)
    plan = dict(tile_source_ptr="*i64", tile_first_ptr="*i64", tile_total_ptr="*i64", count_ptr="*i64",
                group_start_ptr="*i64", indptr_ptr="*i64", indices_ptr="*i64", d="i32", T="i32", V="i32")
    forward = {a: "*fp32" for a in E._energy_forward_kernel.arg_names if a.endswith("_ptr")}
    forward.update(plan, out_row_ptr="*i64")
    for label, flags, dtype in (("log Z (training)", dict(LSE=True, LOGITS=False, OUT_ROWS=False), "fp32"),
                                ("logits", dict(LSE=False, LOGITS=True, OUT_ROWS=True), "fp32"),
                                ("log Z bf16 weights", dict(LSE=True, LOGITS=False, OUT_ROWS=False), "bf16")):
        yield (f"energy forward d=32 {label}", E._energy_forward_kernel, dict(forward, w_ptr=f"*{dtype}",
               b_ptr=f"*{dtype}"), dict(tiles, **flags), dict(num_warps=4))
    backward = {a: "*fp32" for a in E._energy_backward_kernel.arg_names if a.endswith("_ptr")}
    backward.update(plan, target_within_ptr="*i64", logit_row_ptr="*i64", slot_ptr="*i64")
    training = dict(LSE=True, TARGET=True, LOGITS=False, LOGIT_ROWS=False, CLEAR_SUCCESSORS=False, NEED_W=True,
                    NEED_B=True, NEED_X=True, NEED_PE=False)
    for label, flags in (("exact loss, sparse gradient", dict(training, SLOTS=True)),
                         ("exact loss, dense gradient", dict(training, SLOTS=False)),
                         ("exact loss, PE's gradient (shared matrix)", dict(training, SLOTS=True, NEED_PE=True)),
                         ("logits' gradient", dict(training, LSE=False, TARGET=False, LOGITS=True,
                                                   CLEAR_SUCCESSORS=True, SLOTS=False))):
        yield (f"energy backward d=32 {label}", E._energy_backward_kernel, backward, dict(tiles, **flags),
               dict(num_warps=8))


def main() -> int:
    global TARGET
    if "--arch" in sys.argv:
        arch = sys.argv[sys.argv.index("--arch") + 1].removeprefix("sm_")  # 80 or sm_80
        TARGET = GPUTarget("hip", arch, 64) if arch.startswith("gfx") else GPUTarget("cuda", int(arch), 32)
    failed = 0
    seen = set()
    for label, fn, types, constants, meta in variants():
        # Triton's launcher passes an int argument equal to 1 as a constant (a one-token sequence, one tile, the
        # first step), which has no tensor methods: the first variant of each kernel, and every optimizer variant
        # (its step count differs by branch), compiles once more with every int argument at 1
        ones = {a: 1 for a, t in types.items() if t in ("i32", "i64")}
        runs = [("", types, constants)]
        if ones and (fn not in seen or fn is triton_optim._sparse_adamw_kernel):
            runs.append((" [int arguments = 1]", {a: t for a, t in types.items() if a not in ones},
                         dict(constants, **ones)))
        seen.add(fn)
        for tag, kind, fixed in runs:
            try:
                print(f"{label}{tag}: {resources(fn, kind, fixed, meta['num_warps'])}", flush=True)
            except Exception as error:  # report every variant, then fail
                failed += 1
                print(f"{label}{tag}: FAILED {type(error).__name__}: {str(error)[-500:]}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
