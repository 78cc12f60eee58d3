"""ModelOpt unified HF format: bit parity with nvidia-modelopt's own exporters, provenance, errors."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from dflash_trt.checkpoint import modelopt_hf, trtllm_legacy
from dflash_trt.checkpoint.provenance import METADATA_KEY, read_provenance
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_target
from dflash_trt.builder.calibration import calibrate_target, calibration_prompts, modelopt_calibrate

pytest.importorskip("modelopt.torch.quantization")


SCALES = (".weight_scale", ".weight_scale_2", ".input_scale")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _assert_same_files(ours: dict, theirs: dict) -> None:
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
        assert torch.equal(_bits(ours[name]), _bits(theirs[name])), name


@pytest.mark.parametrize("arch,algo", [("llama", "FP8"), ("qwen3", "NVFP4")])
def test_hf_and_legacy_exports_are_bit_identical_to_modelopt(tmp_path, arch, algo):
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint

    hf = build_tiny_target(arch, num_layers=2)
    native = native_from_hf(hf)
    prompts = calibration_prompts(2, vocab_size=hf.config.vocab_size)
    ours_cal = calibrate_target(native, prompts)
    cal = modelopt_calibrate(hf, algo, prompts)
    # our hooks see exactly the activations modelopt's max calibrator saw
    assert {k: v for k, v in ours_cal.input_amax.items() if k != "lm_head"} == cal.input_amax

    export_hf_checkpoint(hf, export_dir=str(tmp_path / "mo_hf"))
    modelopt_hf.write_target(native, tmp_path / "our_hf", algo, cal)
    _assert_same_files(load_file(tmp_path / "our_hf" / "model.safetensors"),
                       load_file(tmp_path / "mo_hf" / "model.safetensors"))
    theirs = json.loads((tmp_path / "mo_hf" / "hf_quant_config.json").read_text())
    ours = json.loads((tmp_path / "our_hf" / "hf_quant_config.json").read_text())
    assert ours == theirs
    qc_ours = json.loads((tmp_path / "our_hf" / "config.json").read_text())["quantization_config"]
    qc_theirs = json.loads((tmp_path / "mo_hf" / "config.json").read_text())["quantization_config"]
    assert qc_ours == qc_theirs

    # a fresh twin: modelopt's HF export changes the model's quantizer state in place
    hf = build_tiny_target(arch, num_layers=2)
    assert modelopt_calibrate(hf, algo, prompts).input_amax == cal.input_amax
    decoder = "llama" if arch == "llama" else "qwen"
    export_tensorrt_llm_checkpoint(hf, decoder_type=decoder, dtype=torch.float16,
                                   export_dir=str(tmp_path / "mo_legacy"), inference_tensor_parallel=2)
    trtllm_legacy.write_checkpoint(native, tmp_path / "our_legacy", algo, cal, tp=2, dtype="float16")
    for rank in range(2):
        _assert_same_files(load_file(tmp_path / "our_legacy" / f"rank{rank}.safetensors"),
                           load_file(tmp_path / "mo_legacy" / f"rank{rank}.safetensors"))
    mo_cfg = json.loads((tmp_path / "mo_legacy" / "config.json").read_text())
    our_cfg = json.loads((tmp_path / "our_legacy" / "config.json").read_text())
    # documented differences: we add moe sizes to mapping and our source config; modelopt adds rank/decoder/producer
    for key in ("architecture", "dtype", "num_hidden_layers", "hidden_size", "head_size", "vocab_size",
                "intermediate_size", "num_key_value_heads"):
        assert our_cfg[key] == mo_cfg[key], key
    assert our_cfg["quantization"]["quant_algo"] == mo_cfg["quantization"]["quant_algo"]
    assert {k: our_cfg["mapping"][k] for k in mo_cfg["mapping"]} == mo_cfg["mapping"]


@pytest.mark.parametrize("algo", ["FP8", "NVFP4"])
@pytest.mark.parametrize("model_dtype, export_dtype", [(torch.bfloat16, None), (torch.float32, torch.bfloat16)])
def test_hf_export_from_bf16_is_bit_identical_to_modelopt(tmp_path, algo, model_dtype, export_dtype):
    """Released checkpoints are bf16: ModelOpt rounds the FP8 quotient to bf16 before the e4m3 cast
    (a second rounding) and encodes NVFP4 from the bf16 weight with scales from the model's own
    weight. Ours writes the same bytes, from a bf16 model and from an fp32 one exported to bf16."""
    from modelopt.torch.export import export_hf_checkpoint

    hf = build_tiny_target("llama", num_layers=2, dtype=model_dtype)
    native = native_from_hf(hf)
    prompts = calibration_prompts(2, vocab_size=hf.config.vocab_size)
    cal = modelopt_calibrate(hf, algo, prompts)
    export_hf_checkpoint(hf, dtype=export_dtype, export_dir=str(tmp_path / "mo"))
    modelopt_hf.write_target(native, tmp_path / "ours", algo, cal, dtype=export_dtype)
    theirs = load_file(tmp_path / "mo" / "model.safetensors")
    ours = load_file(tmp_path / "ours" / "model.safetensors")
    assert ours["model.embed_tokens.weight"].dtype == torch.bfloat16
    if export_dtype is not None:
        # ModelOpt 0.47 writes the unquantized tensors of an fp32 model in fp32 whatever `dtype` says;
        # ours casts them to the export dtype (what ModelOpt writes for the model held in bf16)
        for name, tensor in theirs.items():
            if tensor.dtype == torch.float32 and tensor.dim() > 0 and not name.endswith(SCALES):
                assert torch.equal(ours[name], tensor.to(torch.bfloat16)), name
                theirs[name] = ours[name]
    _assert_same_files(ours, theirs)
    if algo == "FP8":  # the case the single-rounding writer got wrong: some codes differ by one step
        w = native.model.layers[0].self_attn.q_proj.weight.detach()
        single = (w.float() / theirs["model.layers.0.self_attn.q_proj.weight_scale"]).to(torch.float8_e4m3fn)
        assert not torch.equal(single.view(torch.uint8),
                               theirs["model.layers.0.self_attn.q_proj.weight"].view(torch.uint8))


def test_fp8_export_codes_round_through_the_export_dtype():
    """w / s = 53.91: bf16 rounds it to 54.0, a tie between the e4m3 values 52 and 56 that goes to
    56 (even mantissa); one rounding from fp32 gives 52."""
    from dflash_trt.quant.fp8 import export_codes

    scale = torch.tensor([1.0])
    w = torch.tensor([[53.91, -53.91, 1000.0]])
    assert export_codes(w, scale, torch.bfloat16).float().tolist() == [[56.0, -56.0, 448.0]]
    assert export_codes(w, scale, torch.float32).float().tolist() == [[52.0, -52.0, 448.0]]


def test_provenance_in_json_and_metadata(tmp_path):
    hf = build_tiny_target("llama")
    src = tmp_path / "src"
    hf.save_pretrained(str(src))
    native = native_from_hf(hf)
    cal = calibrate_target(native, calibration_prompts(1, vocab_size=256))
    out = modelopt_hf.write_target(native, tmp_path / "q", "FP8", cal, source_dir=src)
    prov = read_provenance(out)
    assert prov["tool"] == "dflash_trt" and prov["format"] == "modelopt-hf"
    assert prov["quantization"]["quant_algo"] == "FP8"
    assert prov["quantization"]["calibration"]["method"] == "dflash_trt-hooks"
    assert len(prov["sources"]["target"]["model.safetensors"]) == 64
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        assert json.loads(fh.metadata()[METADATA_KEY]) == prov
    assert not list(tmp_path.glob(".q.tmp-*"))  # atomic: no temp directory left


def test_unsupported_algo_and_missing_or_extra_tensors(tmp_path):
    native = native_from_hf(build_tiny_target("llama"))
    with pytest.raises(ConfigError, match="supported"):
        modelopt_hf.write_target(native, tmp_path / "x", "INT4_AWQ")
    with pytest.raises(ConfigError, match="cannot be written"):
        modelopt_hf.write_target(native, tmp_path / "x", "FP8_PER_CHANNEL_PER_TOKEN")
    out = modelopt_hf.write_target(native, tmp_path / "w", "NVFP4")  # weight-only
    state = load_file(out / "model.safetensors")
    state.pop("model.layers.1.self_attn.q_proj.weight_scale_2")
    state["model.layers.0.bogus"] = torch.zeros(1)
    from safetensors.torch import save_file

    save_file(state, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"q_proj.weight_scale_2.*bogus"):
        modelopt_hf.load_target(out)
    with pytest.raises(CheckpointError, match="hf_quant_config"):
        modelopt_hf.read_quant_config(tmp_path)
