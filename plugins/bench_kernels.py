"""Time each DFlash kernel (Triton) against its torch reference on a CUDA GPU.

    python -m plugins.bench_kernels [--iters 100]

Sizes follow the DFlash decode step of a gpt-oss-class target: batch 1/8/32, K = 15 drafts
(block 16), hidden 2880, 5 taps, 8 kv heads x head_dim 64, 1 and 8 draft layers. Times come
from CUDA events (median over iterations after a warm-up). Without CUDA (or triton) it prints
why and exits with status 2.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from plugins.kernels import ContextKVWeights, triton_available
from dflash_trt.speculative.verify import accept_tokens_ref  # the acceptance reference lives with the rule
from plugins.kernels.reference import pack_taps_ref, write_context_kv_ref

K, HIDDEN, N_TAPS, KV_HEADS, HEAD_DIM, MAX_LEN = 15, 2880, 5, 8, 64, 4096
BATCHES, LAYERS = (1, 8, 32), (1, 8)


@dataclass(frozen=True)
class Timing:
    kernel: str
    shape: str
    torch_ms: float
    triton_ms: float

    @property
    def speedup(self) -> float:
        return self.torch_ms / self.triton_ms


def time_ms(fn: Callable[[], object], iters: int, warmup: int = 10) -> float:
    """Median milliseconds per call, measured with CUDA events."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def _weights(layers: int) -> ContextKVWeights:
    def rnd(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)

    return ContextKVWeights(
        fc_weight=rnd(HIDDEN, N_TAPS * HIDDEN),
        hidden_norm_weight=torch.ones(HIDDEN, device="cuda", dtype=torch.bfloat16),
        k_proj_weight=rnd(layers, KV_HEADS * HEAD_DIM, HIDDEN),
        v_proj_weight=rnd(layers, KV_HEADS * HEAD_DIM, HIDDEN),
        k_norm_weight=torch.ones(layers, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, eps=1e-6)


def run(iters: int) -> list[Timing]:
    from plugins.kernels.triton_accept import launch_accept
    from plugins.kernels.triton_context_kv import launch_context_kv
    from plugins.kernels.triton_pack import launch_pack_taps

    dev, out = "cuda", []
    for b in BATCHES:
        target = torch.randint(0, 8, (b, K + 1), device=dev)
        draft, dlens = target[:, :K].clone(), torch.full((b,), K, device=dev)
        start = torch.zeros(b, dtype=torch.int64, device=dev)
        args = (draft, target, dlens, start)
        out.append(Timing("accept_tokens", f"B={b} K={K}",
                          time_ms(lambda: accept_tokens_ref(*args), iters),
                          time_ms(lambda: launch_accept(*args), iters)))
        taps = torch.randn(N_TAPS, b, K + 1, HIDDEN, device=dev, dtype=torch.bfloat16)
        acc = torch.randint(0, K + 1, (b,), device=dev)
        out.append(Timing("pack_taps", f"B={b} taps={N_TAPS} H={HIDDEN} bf16",
                          time_ms(lambda: pack_taps_ref(taps, acc), iters),
                          time_ms(lambda: launch_pack_taps(taps, acc), iters)))
        for layers in LAYERS:
            w, n = _weights(layers), b * (K + 1)
            feats = torch.randn(n, N_TAPS * HIDDEN, device=dev, dtype=torch.bfloat16)
            rows = torch.arange(b, device=dev).repeat_interleave(K + 1)
            pos = torch.arange(K + 1, device=dev).repeat(b) + 1000
            freq = 1.0 / 150000 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM)
            shape = (layers, b, KV_HEADS, MAX_LEN, HEAD_DIM)
            kc = torch.zeros(shape, device=dev, dtype=torch.bfloat16)
            vc = torch.zeros_like(kc)
            kv_args = (feats, rows, pos, w, freq, kc, vc)
            out.append(Timing("write_context_kv", f"B={b} N={n} layers={layers} bf16",
                              time_ms(lambda: write_context_kv_ref(*kv_args), iters),
                              time_ms(lambda: launch_context_kv(*kv_args), iters)))
    return out


def format_table(rows: list[Timing]) -> str:
    head = f"{'kernel':<18} {'shape':<34} {'torch ms':>9} {'triton ms':>10} {'speedup':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r.kernel:<18} {r.shape:<34} {r.torch_ms:>9.4f} {r.triton_ms:>10.4f} "
                     f"{r.speedup:>7.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plugins.bench_kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=100, help="timed calls per measurement")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("plugins.bench_kernels needs a CUDA GPU (torch.cuda.is_available() is False); "
              "the kernels' correctness on CPU is covered by tests/plugins.", file=sys.stderr)
        return 2
    if not triton_available():
        print("plugins.bench_kernels needs triton: pip install 'triton>=3.0'", file=sys.stderr)
        return 2
    print(f"device: {torch.cuda.get_device_name()}  (speedup = torch ms / triton ms; "
          "write_context_kv includes the shared torch matmuls)")
    print(format_table(run(args.iters)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
