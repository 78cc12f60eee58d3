"""Tiny random-weight targets and drafters built from configs (tests, demos; no downloads).

The tiny gpt-oss keeps the real model's layout at toy size: alternating sliding/full attention,
attention sinks, biased SwiGLU top-k experts, YaRN RoPE.
"""
from __future__ import annotations

from pathlib import Path

import torch

from dflash_trt.config import DRAFTER_ARCHITECTURE, default_target_layer_ids
from dflash_trt.errors import ConfigError

TINY_ARCHS = ("llama", "qwen3", "gpt_oss")


def tiny_target_config(arch: str, vocab_size: int = 256, num_layers: int = 6, hidden_size: int = 64, **overrides):
    """A transformers config for a toy target of architecture `arch`."""
    common = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=hidden_size // 4, max_position_embeddings=1024, rms_norm_eps=1e-6,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )
    if arch == "llama":
        from transformers import LlamaConfig

        common.update(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        common.update(overrides)
        return LlamaConfig(**common)
    if arch == "qwen3":
        from transformers import Qwen3Config

        common.update(rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        common.update(overrides)
        return Qwen3Config(**common)
    if arch == "gpt_oss":
        from transformers import GptOssConfig

        common.update(
            num_local_experts=8, num_experts_per_tok=2, sliding_window=8, attention_bias=True,
            layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                             "original_max_position_embeddings": 32, "beta_fast": 32.0, "beta_slow": 1.0,
                             "truncate": False},
            swiglu_limit=7.0,
        )
        common.update(overrides)
        config = GptOssConfig(**common)
        config._attn_implementation = "eager"  # sinks need the eager kernel
        config._experts_implementation = "eager"  # the grouped-mm kernel has no float64
        return config
    raise ConfigError(f"unknown tiny architecture '{arch}' (choose from {TINY_ARCHS})")


def build_tiny_target(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kw):
    """A random-weight transformers causal LM (std 0.1 so logits are far from ties)."""
    from transformers import AutoModelForCausalLM

    config = tiny_target_config(arch, **config_kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1 if param.dim() > 1 else 0.05)
    model.config.architectures = [type(model).__name__]
    return model.eval()


def tiny_drafter_config(target_config, num_layers: int = 1, target_layer_ids: list[int] | None = None,
                        block_size: int = 8, mask_token_id: int | None = None, **overrides) -> dict:
    """A DFlash drafter config.json dict matched to `target_config`."""
    n_target = target_config.num_hidden_layers
    hidden = target_config.hidden_size
    cfg = {
        "architectures": [DRAFTER_ARCHITECTURE],
        "model_type": "qwen3",
        "block_size": block_size,
        "num_target_layers": n_target,
        "dflash_config": {
            "mask_token_id": target_config.vocab_size - 1 if mask_token_id is None else mask_token_id,
            "target_layer_ids": target_layer_ids if target_layer_ids is not None else default_target_layer_ids(n_target, max(num_layers, 2)),
        },
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": hidden // 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": target_config.vocab_size,
        "max_position_embeddings": target_config.max_position_embeddings,
        "attention_bias": False,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def save_tiny_target(model, directory: Path) -> Path:
    directory = Path(directory)
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def build_tiny_drafter(target_config, seed: int = 0, dtype: torch.dtype = torch.float32, **config_kw):
    """A random-weight DFlash drafter matched to `target_config` (std 0.1, norms near 1)."""
    from dflash_trt.config import DrafterConfig
    from dflash_trt.models.drafter import DFlashDrafter

    cfg = DrafterConfig.from_dict(tiny_drafter_config(target_config, **config_kw))
    torch.manual_seed(seed)
    model = DFlashDrafter(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.1)
    return model.to(dtype).eval()


CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TINY_SPECIALS = ("<pad>", "<s>", "<|im_end|>", "<|im_start|>", "<mask>")  # ids 0..4 (pad, bos, eos, ...)


def random_prompts(n: int, seed: int, vocab_size: int, min_len: int = 4, max_len: int = 12) -> list[list[int]]:
    """`n` prompts of random token ids in [3, vocab_size), each of a length drawn from
    [min_len, max_len), reproducible from `seed` (for the tiny models' tests)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (int(torch.randint(min_len, max_len, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def build_tiny_tokenizer():
    """A byte-level tokenizer (4 specials... then 256 bytes; vocab 261) with a ChatML chat template.
    Any text round-trips; ids: <pad>=0, <s>=1, <|im_end|>=2 (eos), <|im_start|>=3, <mask>=4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(TINY_SPECIALS)}
    for ch in sorted(alphabet):
        vocab[ch] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(TINY_SPECIALS))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="<|im_end|>",
                                  mask_token="<mask>")
    tok.chat_template = CHATML_TEMPLATE
    return tok


TINY_TOKENIZER_VOCAB = len(TINY_SPECIALS) + 256


def save_tiny_checkpoint(directory: Path, arch: str = "llama", seed: int = 0, drafter_layers: int = 1,
                         block_size: int = 8, **config_kw) -> tuple[Path, Path]:
    """Write a tiny target (with the byte-level tokenizer) to directory/target and a random drafter
    to directory/drafter. Returns (target_dir, drafter_dir)."""
    directory = Path(directory)
    config_kw.setdefault("vocab_size", TINY_TOKENIZER_VOCAB)
    model = build_tiny_target(arch, seed=seed, **config_kw)
    target_dir = save_tiny_target(model, directory / "target")
    build_tiny_tokenizer().save_pretrained(str(target_dir))
    drafter = build_tiny_drafter(model.config, seed=seed, num_layers=drafter_layers, block_size=block_size,
                                 mask_token_id=4)
    drafter_dir = drafter.save_pretrained(directory / "drafter")
    return target_dir, drafter_dir


TINY_GPT_OSS_RELEASE = "tiny-gpt-oss-mxfp4"  # folder (under the cache) of the stand-in `@tiny-gpt-oss`


def save_tiny_gpt_oss_release(directory: Path, seed: int = 0, block_size: int = 8) -> tuple[Path, Path]:
    """A toy gpt-oss in the layout of the openai/gpt-oss releases (MXFP4 experts, BF16 elsewhere,
    `quantization_config.quant_method: mxfp4`, byte-level tokenizer) at directory/target, and a
    BF16 DFlash drafter for it at directory/drafter. Deterministic for a seed."""
    from dflash_trt.checkpoint.gpt_oss import write_mxfp4_release

    directory = Path(directory)
    model = build_tiny_target("gpt_oss", seed=seed, vocab_size=TINY_TOKENIZER_VOCAB)
    target_dir = write_mxfp4_release(model, directory / "target")
    build_tiny_tokenizer().save_pretrained(str(target_dir))
    drafter = build_tiny_drafter(model.config, seed=seed, num_layers=1, block_size=block_size, mask_token_id=4,
                                 torch_dtype="bfloat16")
    drafter_dir = drafter.save_pretrained(directory / "drafter", dtype=torch.bfloat16)
    return target_dir, drafter_dir


def ensure_tiny_gpt_oss(cache_root: Path) -> Path:
    """The `@tiny-gpt-oss` stand-in under `cache_root`, written once (atomically); returns its root
    (holding target/ and drafter/)."""
    from dflash_trt.fileio import atomic_directory

    root = Path(cache_root) / TINY_GPT_OSS_RELEASE
    if not ((root / "target" / "config.json").is_file() and (root / "drafter" / "config.json").is_file()):
        with atomic_directory(root) as tmp:
            save_tiny_gpt_oss_release(tmp)
    return root
