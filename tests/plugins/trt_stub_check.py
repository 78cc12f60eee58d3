"""Run plugins/trt/qdp.py against a stand-in `tensorrt.plugin` (no TensorRT can be installed here).

Run as a script WITHOUT TRITON_INTERPRET (the AOT path compiles real PTX). It checks what can
be checked without TensorRT: the module imports, every decorator receives a callable for the
right plugin id, descriptors produce the documented shapes, and the AOT implementations return
PTX whose entry matches the kernel name and whose launch grid follows the input shapes. The
stand-in models only the API surface qdp.py uses; real TensorRT is exercised in tests/gpu.
Prints one JSON object.
"""
from __future__ import annotations

import json
import sys
import types


class Expr:
    """A constant shape expression (the stand-in for trtp.ShapeExpr)."""

    def __init__(self, value: int) -> None:
        self.constant_value, self.is_constant = value, True

    def __mul__(self, other: "Expr | int") -> "Expr":
        return Expr(self.constant_value * (other.constant_value if isinstance(other, Expr) else other))


class Desc:
    def __init__(self, shape: tuple[int, ...], dtype: str) -> None:
        self.shape_expr, self.dtype = [Expr(s) for s in shape], dtype

    def like(self) -> "Desc":
        return Desc(tuple(e.constant_value for e in self.shape_expr), self.dtype)


def _install_stub(registry: dict) -> None:
    trt = types.ModuleType("tensorrt")
    trt.float32, trt.float16, trt.bfloat16 = "float32", "float16", "bfloat16"
    trtp = types.ModuleType("tensorrt.plugin")

    def deco(kind):
        return lambda plugin_id: (lambda fn: registry.setdefault(plugin_id, {}).update({kind: fn}) or fn)

    trtp.register, trtp.autotune, trtp.impl, trtp.aot_impl = (
        deco("register"), deco("autotune"), deco("impl"), deco("aot_impl"))
    trtp.TensorDesc = trtp.Tensor = trtp.SymExprs = trtp.AutoTuneCombination = object
    trtp.KernelLaunchParams = types.SimpleNamespace
    trtp.AutoTuneCombination = lambda types_, layout: (types_, layout)
    trtp.cdiv = lambda a, b: Expr(-(-(a.constant_value if isinstance(a, Expr) else a) // b))
    trtp.SymInt32 = lambda e: e.constant_value
    trtp.SymIntExprs = types.SimpleNamespace(from_tuple=list)
    trtp.from_shape_expr = lambda shape, dtype: Desc(tuple(e.constant_value for e in shape), dtype)
    trt.plugin = trtp
    sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, trtp


def main() -> None:
    import torch

    registry: dict = {}
    _install_stub(registry)
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    from plugins.trt import qdp

    report: dict = {"kinds": {pid: sorted(fns) for pid, fns in registry.items()}}
    acc = registry[qdp.ACCEPT_ID]
    ins = [Desc((3, 15), "int64"), Desc((3, 16), "int64"), Desc((3,), "int64"), Desc((3,), "int64")]
    outs = acc["register"](*ins, block_k=16)
    report["accept_out_shapes"] = [[e.constant_value for e in o.shape_expr] for o in outs]
    report["accept_autotune"] = acc["autotune"](*ins, outs)
    name, ptx, params, scalars = acc["aot_impl"](*ins, 16, outs, 0)
    report["accept_aot"] = {"name": name.decode(), "entry": f".entry {name.decode()}" in ptx.decode(),
                            "grid_x": params.grid_x.constant_value, "scalars": scalars,
                            "block_x": params.block_x}
    pack = registry[qdp.PACK_ID]
    taps, accepted = Desc((5, 2, 16, 2880), "bfloat16"), Desc((2,), "int64")
    outs = pack["register"](taps, accepted, block_h=1024)
    report["pack_out"] = [[[e.constant_value for e in o.shape_expr], o.dtype] for o in outs]
    name, ptx, params, scalars = pack["aot_impl"](taps, accepted, 1024, outs, 0)
    report["pack_aot"] = {"name": name.decode(), "bf16": ".b16" in ptx.decode(),
                          "grid": [params.grid_x.constant_value, params.grid_y.constant_value,
                                   params.grid_z.constant_value], "scalars": scalars}
    try:
        acc["register"](*ins, block_k=8)
    except ValueError as exc:  # InputError is a ValueError
        report["block_k_error"] = str(exc)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
