"""Chat prompts the target writes itself, many at once (Magpie-style self-prompting).

Magpie (arXiv 2406.08464) observes that an instruct model, given only its chat template up to
the user-turn header, writes a plausible user request. We render the target's own template with
a placeholder user message, cut it at the placeholder, optionally add a starter word ("Write",
"Explain", ...) for topical spread, and let the target sample continuations -- all rows in one
batched run of our engine, each row with its own seed, so the result is reproducible and costs a
few minutes rather than hours at batch 1. `train.data.clean_generated_prompt` keeps finished,
wordy, mostly-letter turns; duplicates (by normalized words) are dropped. The eval-overlap filter
is applied by the caller like for every prompt source.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

from tqdm.auto import tqdm

from dflash_trt.engine import SamplingParams
from dflash_trt.prompts import Prompt
from dflash_trt.errors import ConfigError, InputError
from dflash_trt.train.data import clean_generated_prompt, words

PLACEHOLDER = "\u2063PLACEHOLDER\u2063"
STARTERS = ("", "", "", "Write", "Explain", "What", "How", "Can you", "Describe", "Compose", "Imagine",
            "Give me", "Suggest", "Compare", "Solve", "Create", "Summarize", "Help me", "Why", "List",
            "Pretend", "Draft", "Calculate", "Translate", "Tell me")


@dataclass(frozen=True)
class SelfPromptRecipe:
    count: int = 1000  # prompts wanted
    seed: int = 0
    temperature: float = 1.0
    top_p: float = 0.95
    max_new_tokens: int = 96
    batch_size: int = 64
    max_rounds: int = 8  # rounds of `count` attempts at most
    starters: tuple[str, ...] = STARTERS

    def __post_init__(self) -> None:
        if self.count < 0 or self.batch_size < 1 or self.max_new_tokens < 8 or self.max_rounds < 1:
            raise ConfigError("need count >= 0, batch_size >= 1, max_new_tokens >= 8, max_rounds >= 1")
        if not self.temperature > 0 or not 0 < self.top_p <= 1:
            raise ConfigError("need temperature > 0 and 0 < top_p <= 1")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def user_header(tokenizer) -> str:
    """The chat template rendered up to where the user's text starts (system turn included)."""
    if tokenizer.chat_template is None:
        raise InputError("the tokenizer has no chat template: self-prompting needs one")
    text = tokenizer.apply_chat_template([{"role": "user", "content": PLACEHOLDER}], tokenize=False,
                                         add_generation_prompt=False)
    if PLACEHOLDER not in text:
        raise InputError("the chat template does not render the user's text verbatim")
    return text.split(PLACEHOLDER)[0]


def self_prompts_batched(engine, tokenizer, recipe: SelfPromptRecipe, progress: bool = False) -> list[Prompt]:
    """`recipe.count` unique cleaned prompts sampled from the target on `engine` (a
    speculative-off engine with max_batch_size >= recipe.batch_size)."""
    header = user_header(tokenizer)
    bar = tqdm(total=recipe.count, desc="self-prompts", unit="prompt", disable=not progress)
    rng = random.Random(recipe.seed)
    seen: set[tuple[str, ...]] = set()
    out: list[Prompt] = []
    attempts = 0
    while len(out) < recipe.count and attempts < recipe.max_rounds * max(recipe.count, 1):
        n = min(recipe.batch_size, 2 * (recipe.count - len(out)) + 8)
        starters = [rng.choice(recipe.starters) for _ in range(n)]
        prefixes = [list(tokenizer.encode(header + s, add_special_tokens=False)) for s in starters]
        params = [SamplingParams(temperature=recipe.temperature, top_p=recipe.top_p, seed=rng.randrange(2**31),
                                 max_new_tokens=recipe.max_new_tokens) for _ in range(n)]
        attempts += n
        for starter, res in zip(starters, engine.generate(prefixes, params)):
            body = tokenizer.decode(res.tokens)
            text = clean_generated_prompt((starter + body) if starter else body)
            key = tuple(words(text)) if text else ()
            if text is None or key in seen:
                continue
            seen.add(key)
            out.append(Prompt(f"self/{len(out)}", "self-chat", text, "chat"))
            bar.update(1)
            if len(out) >= recipe.count:
                break
    bar.close()
    return out
