"""Step-cost measurement: the table has every size, the 1-token ratio is 1, bad input is refused."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.bench.step_cost import measure_step_costs
from dflash_trt.errors import InputError
from dflash_trt.models.target import native_from_hf
from dflash_trt.models.tiny import build_tiny_drafter, build_tiny_target


def test_step_costs_table():
    hf = build_tiny_target("llama", seed=0)
    drafter = build_tiny_drafter(hf.config, seed=0, num_layers=1, block_size=8)
    target = native_from_hf(hf, torch.float32)
    costs = measure_step_costs(target, drafter, context=40, sizes=(1, 4, 8), repeats=3, threads=1)
    assert set(costs.verify_ratio) == {1, 4, 8} and costs.verify_ratio[1] == 1.0
    assert costs.one_token_s > 0 and costs.draft_ratio is not None and costs.draft_ratio > 0
    assert costs.threads == 1 and costs.to_dict()["context"] == 40
    assert costs.draft_vocab_ratio is None  # no draft vocabulary: one draft timing
    drafter.set_draft_vocab(torch.arange(0, hf.config.vocab_size, 4))
    with_vocab = measure_step_costs(target, drafter, context=40, sizes=(1,), repeats=3, threads=1)
    assert with_vocab.draft_vocab_ratio is not None and with_vocab.draft_vocab_ratio > 0
    no_drafter = measure_step_costs(target, None, context=10, sizes=(2,), repeats=1)
    assert no_drafter.draft_ratio is None and set(no_drafter.verify_ratio) == {1, 2}
    with pytest.raises(InputError):
        measure_step_costs(target, None, context=hf.config.max_position_embeddings, sizes=(8,))
