"""Compile every kernel for an H100/H200 (sm_90) without a GPU: ptxas ships with triton.

The interpreter forgives what the compiler refuses (loop-carried type changes, globals
that are not constexpr, bad layouts), so the CPU tests run this in a subprocess with
TRITON_INTERPRET unset. Prints one line per kernel with its resource usage.
"""
import os
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from generation_service.kernels import (decode_attention, decode_fused, decode_prologue,
                                        extend_attention, fp8_gemm, gemv, kv_write, mask_gather, mask_sample,
                                        philox, prepare_inputs, rmsnorm, rotary, stamp, step_epilogue)

TARGET = GPUTarget("cuda", 90, 32)
TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32",
         torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
BF, F32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
F8 = torch.empty(1, dtype=torch.float8_e4m3fn)
I32, I64 = torch.empty(1, dtype=torch.int32), torch.empty(1, dtype=torch.int64)
N = 1024  # strides and sizes: multiples of 16, as the launcher would specialise them


def compile_sm90(fn, *args, num_warps=4, num_stages=2, **constexprs):
    signature, attrs, values = {}, {}, list(args)
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        value = values.pop(0)
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + TYPES[value.dtype]
        else:
            signature[name] = "fp32" if isinstance(value, float) else "i32"
        if isinstance(value, torch.Tensor) or (isinstance(value, int) and value % 16 == 0
                                               and value):
            attrs[(i,)] = [["tt.divisibility", 16]]
    assert not values, "too many arguments"
    kernel = triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs),
                            target=TARGET,
                            options=dict(num_warps=num_warps, num_stages=num_stages))
    return kernel


def resource_usage(kernel) -> str:
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                             "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        out = subprocess.run([cuobjdump, "--dump-resource-usage", f.name],
                             capture_output=True, text=True).stdout
    return " ".join(line.split("Resource usage:")[-1].strip()
                    for line in out.splitlines() if "REG:" in line)


def check_publish_order(ptx: str) -> None:
    """The folded step tail: every thread fences its stores system-wide, then the CTA
    barrier, then the seq word's store; no store to global memory between fence and barrier."""
    lines = [line.strip() for line in ptx.splitlines()]
    fence = [i for i, line in enumerate(lines) if line.startswith("fence.sc.sys")]
    barrier = [i for i, line in enumerate(lines) if line.startswith(("bar.sync", "barrier.sync"))]
    seq = [i for i, line in enumerate(lines) if "st.relaxed.sys.global" in line]
    assert fence and barrier and seq, f"fence {fence} barrier {barrier} seq store {seq}"
    stores = [i for i, line in enumerate(lines) if "st.global" in line and "st.relaxed.sys" not in line]
    channel_stores = [i for i in stores if i < fence[0]]
    assert channel_stores and max(fence) < min(barrier) < min(seq), (fence, barrier, seq)
    late = [lines[i] for i in stores if fence[0] < i < min(seq)]
    assert not late, f"stores between the fence and the seq store: {late}"


def check_inputs_publish(ptx: str) -> None:
    """The prologue's inputs_seq: a system fence before the seq word's system-scope store."""
    lines = [line.strip() for line in ptx.splitlines()]
    fence = [i for i, line in enumerate(lines) if line.startswith("fence.sc.sys")]
    seq = [i for i, line in enumerate(lines) if "st.relaxed.sys.global" in line]
    assert fence and seq and max(fence) < min(seq), (fence, seq)


CHECKS = {"step_epilogue_publish": check_publish_order, "decode_prologue_publish": check_inputs_publish}


def main() -> int:
    da, ea, ms = decode_attention, extend_attention, mask_sample
    builds = {
        "decode_split": lambda: compile_sm90(
            da._decode_split_kernel, BF, BF, BF, I32, I32, F32, F32, BF, 0.1, 1.0, 0, *[N] * 17,
            GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, BLOCK_N=64, PAGE_SIZE=16,
            NUM_SPLITS=8, PDL=True),
        "decode_split_fp8_kv": lambda: compile_sm90(
            da._decode_split_kernel, BF, F8, F8, I32, I32, F32, F32, BF, 0.1, 0.5, 0, *[N] * 17,
            GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=16, BLOCK_N=64, PAGE_SIZE=16,
            NUM_SPLITS=8, PDL=True),
        "decode_reduce": lambda: compile_sm90(
            da._decode_reduce_kernel, F32, F32, BF, *[N] * 7, NUM_SPLITS=8, BLOCK_S=8,
            HEAD_DIM=128, BLOCK_D=128, PDL=True),
        "extend": lambda: compile_sm90(
            ea._extend_kernel, BF, BF, BF, BF, I32, I32, I32, I64, 0.1, 1.0, 0, 7, N, *[N] * 12, I32, I32,
            GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, PAGE_SIZE=16,
            BLOCK_G=4, TILED=False),
        "extend_prefill_tile": lambda: compile_sm90(
            ea._extend_kernel, BF, BF, BF, BF, I32, I32, I32, I64, 0.1, 1.0, 0, 7, N, *[N] * 12, I32, I32,
            GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64, PAGE_SIZE=16,
            BLOCK_G=4, TILED=False, num_warps=8),
        "extend_tiled": lambda: compile_sm90(
            ea._extend_kernel, BF, BF, BF, BF, I32, I32, I32, I64, 0.1, 1.0, 0, 7, N, *[N] * 12, I64, I64,
            GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64, PAGE_SIZE=16,
            BLOCK_G=4, TILED=True, num_warps=8),
        "extend_tiled_head_dim_64": lambda: compile_sm90(  # the 1B's mixed steps: one stage
            ea._extend_kernel, BF, BF, BF, BF, I32, I32, I32, I64, 0.1, 1.0, 0, 7, N, *[N] * 12, I64, I64,
            GROUP=4, HEAD_DIM=64, BLOCK_D=64, BLOCK_M=128, BLOCK_N=64, PAGE_SIZE=16,
            BLOCK_G=4, TILED=True, num_warps=8, num_stages=1),
        "extend_tiled_fp8_kv": lambda: compile_sm90(
            ea._extend_kernel, BF, F8, F8, BF, I32, I32, I32, I64, 0.1, 0.5, 0, 7, N, *[N] * 12, I64, I64,
            GROUP=4, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=128, BLOCK_N=64, PAGE_SIZE=16,
            BLOCK_G=4, TILED=True, num_warps=8),
        "prepare_inputs": lambda: compile_sm90(
            prepare_inputs._prepare_kernel, I64, I32, I32, I32, I32, I64, I64, I32, I32, I64,
            *[N] * 5, PAGE_SIZE=16, BLOCK_R=256, BLOCK_W=4, BLOCK_T=1024),
        "kv_write": lambda: compile_sm90(
            kv_write._kv_write_kernel, BF, BF, BF, BF, I64, *[N] * 4, 1.0, 1.0, ROW=1024, BLOCK=1024,
            QUANT=False),
        "kv_write_fp8": lambda: compile_sm90(
            kv_write._kv_write_kernel, BF, BF, F8, F8, I64, *[N] * 4, 0.5, 2.0, ROW=1024, BLOCK=1024,
            QUANT=True),
        "philox": lambda: compile_sm90(philox._uniform_kernel, I64, I64, F32, N, BLOCK=1024),
        "mask_sample_partial": lambda: compile_sm90(
            ms._partial_kernel, F32, I32, I64, F32, I64, I64, F32, *[N] * 6, HAS_MASK=True,
            MASK_RING=False, NUM_SPLITS=4, BLOCK=1024, BLOCK_W=1024),
        "mask_sample_partial_ring": lambda: compile_sm90(
            ms._partial_kernel, BF, I32, I64, F32, I64, I64, F32, *[N] * 6, HAS_MASK=True,
            MASK_RING=True, NUM_SPLITS=16, BLOCK=1024, BLOCK_W=1024),
        "mask_sample_finalize": lambda: compile_sm90(
            ms._finalize_kernel, BF, I32, I64, F32, I32, F32, I64, I64, F32, I32, F32, *[N] * 5,
            HAS_MASK=True, MASK_RING=False, ENABLE_FILTERS=True, NUM_SPLITS=4, BLOCK_S=4, BLOCK=1024,
            BLOCK_W=1024, PROBES=8, num_warps=8),
        "mask_sample_finalize_ring": lambda: compile_sm90(
            ms._finalize_kernel, BF, I32, I64, F32, I32, F32, I64, I64, F32, I32, F32, *[N] * 5,
            HAS_MASK=True, MASK_RING=True, ENABLE_FILTERS=False, NUM_SPLITS=16, BLOCK_S=16,
            BLOCK=1024, BLOCK_W=1024, PROBES=8),
        "add_rmsnorm": lambda: compile_sm90(
            rmsnorm._rmsnorm_kernel, BF, BF, BF, BF, BF, N, N, N, N, 4096, 1e-5,
            HAS_RESIDUAL=True, HAS_WEIGHT=True, BLOCK=4096, PDL=True, num_warps=8),
        "add_rmsnorm_weightless": lambda: compile_sm90(
            rmsnorm._rmsnorm_kernel, BF, BF, BF, BF, BF, N, N, N, N, 4096, 1e-5,
            HAS_RESIDUAL=True, HAS_WEIGHT=False, BLOCK=4096, PDL=True, num_warps=8),
        "rope_write_kv": lambda: compile_sm90(
            rotary._rope_kernel, BF, BF, BF, BF, BF, BF, BF, BF, I64, *[N] * 11, 1.0, 1.0, QUANT=False,
            NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_HALF=64, BLOCK_H=1, HAS_SLOTS=True, HAS_V=True,
            PDL=True, num_warps=1),
        "rope_write_kv_head_blocks": lambda: compile_sm90(
            rotary._rope_kernel, BF, BF, BF, BF, BF, BF, BF, BF, I64, *[N] * 11, 1.0, 1.0, QUANT=False,
            NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_HALF=64, BLOCK_H=16, HAS_SLOTS=True, HAS_V=True,
            PDL=True, num_warps=4),
        "rope_write_kv_fp8": lambda: compile_sm90(
            rotary._rope_kernel, BF, BF, BF, BF, BF, BF, F8, F8, I64, *[N] * 11, 0.5, 2.0, QUANT=True,
            NUM_HEADS=32, NUM_KV_HEADS=8, HALF=64, BLOCK_HALF=64, BLOCK_H=16, HAS_SLOTS=True, HAS_V=True,
            PDL=True, num_warps=4),
        "rope_qk_in_place": lambda: compile_sm90(
            rotary._rope_kernel, BF, BF, BF, BF, BF, BF, BF, BF, BF, *[N] * 11, 1.0, 1.0, QUANT=False,
            NUM_HEADS=32, NUM_KV_HEADS=8, HALF=48, BLOCK_HALF=64, BLOCK_H=1, HAS_SLOTS=False, HAS_V=False,
            PDL=False, num_warps=1),
        "decode_prologue": lambda: compile_sm90(
            decode_prologue._prologue_kernel, I64, I64, I32, BF, BF, BF, BF, BF, BF, I64, I32, I32,
            131072, 4096, 131072, *[N] * 3, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=1024, PAGE_SIZE=16,
            HAS_PAGES=True, PUBLISH=False, SYS_FENCE=False, PDL=True),
        "decode_prologue_publish": lambda: compile_sm90(
            decode_prologue._prologue_kernel, I64, I64, I32, BF, BF, BF, BF, BF, BF, I64, I32, I32,
            131072, 4096, 131072, *[N] * 3, HEAD_DIM=128, BLOCK_D=128, BLOCK_H=1024, PAGE_SIZE=16,
            HAS_PAGES=True, PUBLISH=True, SYS_FENCE=True, PDL=True),
        "mask_gather": lambda: compile_sm90(
            mask_gather._mask_gather_kernel, I32, I64, I32, 128, 4096, *[N] * 3,
            BLOCK_R=mask_gather.BLOCK_R, BLOCK_W=mask_gather.BLOCK_W, NUM_PROGRAMS=8, num_warps=8),
        "step_epilogue": lambda: compile_sm90(
            step_epilogue._step_epilogue_kernel, I32, I64, I64, I64, I32, I64, I32, I32, I32, I32,
            *[N] * 4, 4, CHANNEL=True, PUBLISH=False, SYS_FENCE=False, BLOCK=128),
        "step_epilogue_publish": lambda: compile_sm90(
            step_epilogue._step_epilogue_kernel, I32, I64, I64, I64, I32, I64, I32, I32, I32, I32,
            *[N] * 4, 4, CHANNEL=True, PUBLISH=True, SYS_FENCE=True, BLOCK=128),
        "stamp": lambda: compile_sm90(stamp._stamp_kernel, I64, I32, N, WHICH=1, num_warps=1),
        "fp8_quantize_rows": lambda: compile_sm90(
            fp8_gemm._quantize_rows_kernel, BF, F8, F32, F32, 4096, N, N, STATIC=False, BLOCK=4096, PDL=True),
        "fp8_quantize_rows_static": lambda: compile_sm90(
            fp8_gemm._quantize_rows_kernel, BF, F8, F32, F32, 4096, N, N, STATIC=True, BLOCK=4096, PDL=True),
        "gemv_dot_fp8_gate_up": lambda: compile_sm90(
            gemv._gemv_dot_kernel, BF, F8, BF, BF, 8, 14336, 4096, N, N, N, BF, F32, N, 0, 0.0, F32,
            HAS_BIAS=False, SILU_MUL=True, EVEN=True, BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, PDL=True,
            ADD_RESIDUAL=False, RMS_SCALE=False, BLOCK_S=1, W_SCALE=True, num_stages=4),
        "gemv_row_fp8": lambda: compile_sm90(
            gemv._gemv_row_kernel, BF, F8, BF, BF, 4096, 14336, N, BF, F32, 0, 0.0, F32,
            HAS_BIAS=False, SILU_MUL=False, EVEN=True, BLOCK_N=8, BLOCK_K=2048, PDL=True,
            ADD_RESIDUAL=False, RMS_SCALE=False, BLOCK_S=1, W_SCALE=True, num_stages=3),
        "silu_mul": lambda: compile_sm90(
            decode_fused._silu_mul_kernel, BF, BF, 14336, BLOCK=1024, PDL=True),
    }
    failed = 0
    for name, build in builds.items():
        try:
            kernel = build()
            CHECKS.get(name, lambda ptx: None)(kernel.asm["ptx"])
            print(f"{name}: ok {resource_usage(kernel)}")
        except Exception as exc:  # report every kernel, then fail
            failed += 1
            print(f"{name}: FAILED {exc!r}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
