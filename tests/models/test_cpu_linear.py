"""Prepacked oneDNN linears (`--cpu-kernels`, dflash_trt/models/cpu_linear.py): the same outputs as
F.linear up to summation order, gradients and training untouched, never stale, the same greedy tokens
from DFlash and autoregressive decoding, and the setting carried by every loader."""
from __future__ import annotations

import argparse

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_trt.engine import EngineConfig, SamplingParams
from dflash_trt.errors import ConfigError
from dflash_trt.models import cpu_linear
from dflash_trt.models.cpu_linear import any_packed, is_packed, prepack, should_pack, unpack
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target, random_prompts, save_tiny_checkpoint
from dflash_trt.runtime.factory import LoadConfig, load_backend

needs_onednn = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="this torch build has no oneDNN ops")


def _linear(out_f=48, in_f=32, bias=True, seed=0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(in_f, out_f, bias=bias)


@needs_onednn
@pytest.mark.parametrize("shape", [(5, 32), (2, 7, 32), (2, 3, 4, 32), (0, 32), (32,)])
def test_packed_linear_matches_f_linear(shape):
    lin = _linear()
    x = torch.randn(*shape)
    with torch.inference_mode():
        want = F.linear(x, lin.weight, lin.bias)
        assert prepack(lin) == 1 and is_packed(lin)
        got = lin(x)
    assert type(lin) is nn.Linear  # the class, its parameters and state dict stay as they were
    assert set(lin.state_dict()) == {"weight", "bias"}
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a non-contiguous input
    xt = torch.randn(7, 2, 32).transpose(0, 1)
    with torch.inference_mode():
        torch.testing.assert_close(lin(xt), F.linear(xt, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_autograd_runs_f_linear_and_gradients_are_unchanged():
    lin, ref = _linear(), _linear()
    prepack(lin)
    x = torch.randn(4, 32, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    out, want = lin(x), ref(xr)
    assert torch.equal(out, want)  # the grad path is exactly F.linear
    out.square().sum().backward()
    want.square().sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(x.grad, xr.grad)


@needs_onednn
def test_packed_copy_follows_in_place_changes_and_replacement():
    lin = _linear()
    prepack(lin)
    x = torch.randn(3, 32)
    with torch.no_grad():
        lin.weight.mul_(-2.0)  # an optimizer step / load_state_dict changes the weight in place
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.load_state_dict({"weight": torch.randn(48, 32), "bias": torch.randn(48)})
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight = nn.Parameter(torch.randn(48, 32))  # replaced by another tensor
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_only_float32_plain_linears_on_cpu_are_packed_and_unpack_restores():
    class Sub(nn.Linear):  # a subclass (as tensor-parallel linears are) keeps its own forward
        pass

    tree = nn.Sequential(_linear(), Sub(48, 48), nn.Linear(48, 16).to(torch.bfloat16))
    assert prepack(tree) == 1
    assert is_packed(tree[0]) and not is_packed(tree[1]) and not is_packed(tree[2]) and any_packed(tree)
    x = torch.randn(2, 32)
    with torch.inference_mode():
        packed_out = tree[0](x)
    assert unpack(tree) == 1 and not any_packed(tree)
    with torch.inference_mode():
        torch.testing.assert_close(tree[0](x), packed_out, rtol=1e-5, atol=1e-5)
        assert torch.equal(tree[0](x), F.linear(x, tree[0].weight, tree[0].bias))
    assert not any_packed(object())


@needs_onednn
def test_should_pack_settings():
    fp32 = [_linear()]
    assert should_pack("torch", fp32) is False
    assert should_pack("auto", fp32) is True
    assert should_pack("onednn", fp32) is True
    bf16 = [_linear().to(torch.bfloat16)]
    assert should_pack("auto", bf16) is False
    with pytest.raises(ConfigError, match="float32 weights on CPU"):
        should_pack("onednn", bf16)
    with pytest.raises(ConfigError, match="cpu kernels must be one of"):
        should_pack("fast", fp32)
    with pytest.raises(ConfigError, match="cpu kernels must be one of"):
        LoadConfig(target="t", drafter=None, cpu_kernels="fast")


def test_should_pack_without_onednn(monkeypatch):
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: False)
    assert should_pack("auto", [_linear()]) is False
    with pytest.raises(ConfigError, match="no oneDNN"):
        should_pack("onednn", [_linear()])


def test_auto_stays_off_when_the_copy_does_not_fit_memory(monkeypatch):
    monkeypatch.setattr(cpu_linear, "onednn_available", lambda: True)
    lin = _linear()  # 48 x 32 float32 = 6144 bytes
    monkeypatch.setattr(cpu_linear, "_physical_memory_bytes", lambda: 4 * 6144)
    assert should_pack("auto", [lin]) is True
    monkeypatch.setattr(cpu_linear, "_physical_memory_bytes", lambda: 4 * 6144 - 4)
    assert should_pack("auto", [lin]) is False
    assert should_pack("onednn", [lin]) is True  # an explicit choice is honoured


@needs_onednn
def test_draft_vocabulary_head_is_packed_with_its_target():
    """The draft-vocabulary head (speculative/draft_head.py) runs its lm_head rows through the same packed
    linear when the target's linears are packed, and plain F.linear when they are not (or are bf16)."""
    from dflash_trt.models.target import native_from_hf
    from dflash_trt.speculative.draft_head import DraftHead

    ids = torch.tensor([7, 3, 40, 11])
    x = torch.randn(2, 7, 64)
    heads = {}
    for name, dtype, pack in (("packed", torch.float32, True), ("plain", torch.float32, False),
                              ("bf16", torch.bfloat16, True)):
        target = native_from_hf(build_tiny_target("llama", seed=4), dtype)
        if pack:
            prepack(target)
        heads[name] = DraftHead(target, ids)
    rows = heads["plain"].weight
    assert torch.equal(rows, heads["packed"].weight)
    with torch.inference_mode():
        want = F.linear(x, rows)
        torch.testing.assert_close(heads["packed"](x)[..., ids], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(heads["plain"](x)[..., ids], want)
        assert torch.isinf(heads["packed"](x)[..., 0]).all()  # outside the draft vocabulary
    assert any_packed(heads["packed"]._linear)
    assert not any_packed(heads["plain"]._linear) and not any_packed(heads["bf16"]._linear)


@needs_onednn
def test_engine_greedy_tokens_dflash_equals_ar_and_unpacked(tmp_path):
    target_dir, drafter_dir = save_tiny_checkpoint(tmp_path, arch="qwen3", seed=3, drafter_layers=2)
    plain = load_backend("torch", LoadConfig(target_dir, drafter_dir, cpu_kernels="torch"))
    packed = load_backend("torch", LoadConfig(target_dir, drafter_dir, cpu_kernels="onednn"))
    assert not any_packed(plain.target) and not any_packed(plain.drafter)
    assert any_packed(packed.target) and any_packed(packed.drafter)
    prompts = random_prompts(4, seed=5, vocab_size=packed.info.vocab_size)
    params = SamplingParams(max_new_tokens=24)
    cfg = EngineConfig(max_batch_size=4, max_seq_len=64)
    ar_plain = [r.tokens for r in plain.engine(EngineConfig(max_batch_size=4, max_seq_len=64, speculative=False))
                .generate(prompts, params)]
    ar = [r.tokens for r in packed.engine(EngineConfig(max_batch_size=4, max_seq_len=64, speculative=False))
          .generate(prompts, params)]
    spec = packed.engine(cfg).generate(prompts, params)
    assert [r.tokens for r in spec] == ar  # the invariant: DFlash emits the target's greedy tokens
    assert ar == ar_plain  # and the packed target's greedy tokens are the unpacked one's here
    assert sum(len(r.steps) for r in spec) < sum(len(t) for t in ar)  # drafts were verified and some accepted


@needs_onednn
def test_packed_models_still_train():
    """A packed drafter trains (autograd takes F.linear) and decodes with the updated weights."""
    hf = build_tiny_target("llama", seed=1)
    drafter = build_tiny_drafter(hf.config, seed=1)
    prepack(drafter)
    opt = torch.optim.SGD(drafter.parameters(), lr=0.1)
    x = torch.randn(2, 5, drafter.fc.in_features)
    loss = drafter.fc(x).square().mean()
    loss.backward()
    opt.step()  # in-place update: the packed copy must follow
    with torch.inference_mode():
        torch.testing.assert_close(drafter.fc(x), F.linear(x, drafter.fc.weight), rtol=1e-5, atol=1e-5)


def test_cli_flag_reaches_the_load_config(tmp_path):
    from dflash_trt.commands.common import add_model_flags, load_config

    p = argparse.ArgumentParser()
    add_model_flags(p)
    (tmp_path / "t").mkdir(), (tmp_path / "d").mkdir()
    dirs = ["--target", str(tmp_path / "t"), "--drafter", str(tmp_path / "d")]
    assert load_config(p.parse_args(dirs + ["--cpu-kernels", "torch"])).cpu_kernels == "torch"
    assert load_config(p.parse_args(dirs)).cpu_kernels == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--cpu-kernels", "fast"])


def test_triton_settings_carry_cpu_kernels():
    from dflash_trt.serve.triton.settings import TritonSettings

    s = TritonSettings.from_dict({"target": "/t", "cpu_kernels": "torch"}, "test")
    assert s.load_config().cpu_kernels == "torch"
    assert TritonSettings.from_dict({"target": "/t"}, "test").load_config().cpu_kernels == "auto"
    with pytest.raises(Exception, match="cpu_kernels"):
        TritonSettings.from_dict({"target": "/t", "cpu_kernels": "fast"}, "test")


@needs_onednn
@pytest.mark.parametrize("kind", ["onednn", "torch"])
def test_bench_peers_run_the_engine_kernels(tmp_path, kind):
    """The transformers peers (hf-generate, hf-prompt-lookup) run on packed linears exactly when the engine
    does, so a bench compares decoding methods, not kernels."""
    from dflash_trt.bench.modes import ModeContext

    target_dir, drafter_dir = save_tiny_checkpoint(tmp_path, arch="llama", seed=2)
    models = load_backend("torch", LoadConfig(target_dir, drafter_dir, cpu_kernels=kind))
    ctx = ModeContext(models=models, engine_config=EngineConfig(), target_dir=target_dir, drafter_dir=drafter_dir,
                      dtype=torch.float32, block_size=8, prompt_lookup_tokens=7)
    assert any_packed(ctx.hf_target()) == (kind == "onednn") == any_packed(models.target)
