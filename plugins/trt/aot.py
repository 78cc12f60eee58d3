"""Ahead-of-time compilation of the plugin kernels to PTX (for `tensorrt.plugin.aot_impl`).

Needs `triton` only (no GPU, no TensorRT): Triton compiles for an explicit CUDA target, so the
PTX that a TensorRT engine would embed can be produced and inspected on any machine.

TensorRT's AOT launch passes the kernel's tensor pointers and int32 scalars in the order
inputs, scalars, outputs, which is how `accept_kernel` and `pack_taps_kernel` declare them.
Triton >= 3.3 appends hidden pointer parameters (global/profile scratch) to every kernel; these
kernels allocate no scratch (checked below), so those parameters are never dereferenced.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from dflash_trt.errors import BackendUnavailableError, InputError

# Triton signature strings for the dtypes the tap-pack plugin accepts.
FLOAT_SIGNATURES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class CompiledKernel:
    """One kernel compiled for one GPU architecture."""

    name: str  # entry point name inside the PTX
    ptx: str  # PTX text
    block_threads: int  # threads per CTA = num_warps * 32
    shared_mem: int  # dynamic shared memory in bytes
    n_params: int  # parameters of the PTX entry (declared + Triton's hidden ones)


def _compile(fn: object, signature: dict[str, str], constexprs: dict[str, int],
             arch: int) -> CompiledKernel:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(fn, InterpretedFunction):
        raise BackendUnavailableError(
            "AOT compilation needs Triton's compiler, but the kernels were imported with "
            "TRITON_INTERPRET=1 (interpreter mode): unset it in the process that builds engines"
        )
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    scratch = int(getattr(compiled.metadata, "global_scratch_size", 0))
    # internal invariant: the AOT launch provides no scratch buffer
    assert scratch == 0, f"{compiled.metadata.name} needs {scratch} B of global scratch"
    ptx = compiled.asm["ptx"]
    name = compiled.metadata.name
    entry = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.S)
    assert entry is not None, f"entry {name} not found in PTX"
    return CompiledKernel(
        name=name,
        ptx=ptx,
        block_threads=int(compiled.metadata.num_warps) * 32,
        shared_mem=int(compiled.metadata.shared),
        n_params=entry.group(1).count(".param"),
    )


def _check_arch(arch: int) -> None:
    if arch < 70:
        raise InputError(f"arch must be a CUDA compute capability like 90 (sm_90), got {arch}")


def accept_signature() -> dict[str, str]:
    return {
        "draft_ptr": "*i64", "target_ptr": "*i64", "draft_lens_ptr": "*i64",
        "start_pos_ptr": "*i64", "n_rows": "i32", "k": "i32", "accepted_ptr": "*i64",
        "bonus_ptr": "*i64", "new_pos_ptr": "*i64", "BLOCK_B": "constexpr",
        "BLOCK_K": "constexpr",
    }


def pack_signature(dtype: str) -> dict[str, str]:
    if dtype not in FLOAT_SIGNATURES:
        raise InputError(f"tap dtype must be one of {sorted(FLOAT_SIGNATURES)}, got {dtype}")
    elem = FLOAT_SIGNATURES[dtype]
    return {
        "taps_ptr": f"*{elem}", "accepted_ptr": "*i64", "n_rows": "i32", "n_slots": "i32",
        "hidden": "i32", "packed_ptr": f"*{elem}", "counts_ptr": "*i64", "BLOCK_H": "constexpr",
    }


def compile_accept(block_k: int, arch: int) -> CompiledKernel:
    """PTX of `accept_kernel` for draft blocks of up to `block_k` (a power of two) slots."""
    from plugins.kernels.triton_accept import BLOCK_B, accept_kernel

    _check_arch(arch)
    if block_k < 1 or block_k & (block_k - 1):
        raise InputError(f"block_k must be a power of two >= 1, got {block_k}")
    return _compile(accept_kernel, accept_signature(),
                    {"BLOCK_B": BLOCK_B, "BLOCK_K": block_k}, arch)


def compile_pack(dtype: str, block_h: int, arch: int) -> CompiledKernel:
    """PTX of `pack_taps_kernel` for taps of `dtype` ('float32' | 'float16' | 'bfloat16')."""
    from plugins.kernels.triton_pack import pack_taps_kernel

    _check_arch(arch)
    if block_h < 1 or block_h & (block_h - 1):
        raise InputError(f"block_h must be a power of two >= 1, got {block_h}")
    return _compile(pack_taps_kernel, pack_signature(dtype), {"BLOCK_H": block_h}, arch)
