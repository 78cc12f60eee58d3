"""dflash TensorRT plugins (JIT and AOT) in a real engine vs the torch reference.

Skipped without CUDA or tensorrt; not executed where this was written (see plugins/README.md).
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from dflash_trt.speculative.verify import accept_tokens_ref
from plugins.kernels.reference import pack_taps_ref

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None, reason="needs tensorrt"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                       reason="AOT needs compiled (not interpreted) Triton kernels"),
]


def _run(build_outputs, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]):
    """Build a one-plugin engine with `build_outputs(network, itensors) -> layer`, run it."""
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    dtypes = {torch.int64: trt.int64, torch.float32: trt.float32, torch.bfloat16: trt.bfloat16}
    itensors = [network.add_input(n, dtypes[t.dtype], tuple(t.shape)) for n, t in inputs.items()]
    layer = build_outputs(network, itensors)
    for i, name in enumerate(outputs):
        layer.get_output(i).name = name
        network.mark_output(layer.get_output(i))
    plan = builder.build_serialized_network(network, builder.create_builder_config())
    assert plan is not None, "engine build failed (see TensorRT log)"
    engine = trt.Runtime(logger).deserialize_cuda_engine(plan)
    context = engine.create_execution_context()
    for name, t in {**inputs, **outputs}.items():
        context.set_tensor_address(name, t.data_ptr())
    stream = torch.cuda.Stream()
    assert context.execute_async_v3(stream.cuda_stream)
    stream.synchronize()


def test_registration_ids():
    from plugins.trt import register_plugins

    ids = register_plugins()
    assert (ids.accept_tokens, ids.pack_taps) == ("dflash::accept_tokens", "dflash::pack_taps")
    assert register_plugins() == ids  # idempotent


@pytest.mark.parametrize("aot", [False, True])
def test_accept_plugin_engine(aot):
    from plugins.trt import register_plugins
    from plugins.trt.qdp import add_accept_tokens

    register_plugins()
    batch, k = 8, 15
    target = torch.randint(0, 3, (batch, k + 1), device="cuda")
    draft = target[:, :k].clone()
    draft[:, 5] += 1
    dlens = torch.randint(0, k + 1, (batch,), device="cuda")
    start = torch.randint(0, 100, (batch,), device="cuda")
    inputs = {"draft": draft, "target": target, "draft_lens": dlens, "start_pos": start}
    outputs = {n: torch.empty(batch, dtype=torch.int64, device="cuda")
               for n in ("accepted", "bonus", "new_pos")}
    _run(lambda net, t: add_accept_tokens(net, *t, block_k=16, aot=aot), inputs, outputs)
    ref = accept_tokens_ref(draft, target, dlens, start)
    assert torch.equal(outputs["accepted"], ref.accepted)
    assert torch.equal(outputs["bonus"], ref.bonus)
    assert torch.equal(outputs["new_pos"], ref.new_pos)


@pytest.mark.parametrize("aot", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_plugin_engine(aot, dtype):
    from plugins.trt import register_plugins
    from plugins.trt.qdp import add_pack_taps

    register_plugins()
    taps = torch.randn(5, 4, 16, 2880, device="cuda", dtype=dtype)
    accepted = torch.tensor([0, 3, 15, 7], device="cuda")
    outputs = {"packed": torch.empty(4, 16, 5 * 2880, device="cuda", dtype=dtype),
               "counts": torch.empty(4, dtype=torch.int64, device="cuda")}
    _run(lambda net, t: add_pack_taps(net, *t, block_h=1024, aot=aot),
         {"taps": taps, "accepted": accepted}, outputs)
    ref = pack_taps_ref(taps, accepted)
    assert torch.equal(outputs["packed"], ref.packed)
    assert torch.equal(outputs["counts"], ref.counts)
