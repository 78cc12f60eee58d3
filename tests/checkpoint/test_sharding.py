"""Pre-sharded HF checkpoints (checkpoint/sharding.py): sliced reads and written rank files equal the
in-memory shards of the split rules; impossible splits write nothing."""
from __future__ import annotations

import pytest
import torch

from dflash_trt.checkpoint.mapping import Dims, Mapping, shard_tensor
from dflash_trt.checkpoint.sharding import (is_presharded, load_presharded_rank, load_rank_state, read_mapping,
                                            write_tp_shards)
from dflash_trt.errors import ConfigError
from dflash_trt.models.tiny import build_tiny_target, save_tiny_target


@pytest.fixture(scope="module")
def targets():
    return {"gpt_oss": build_tiny_target("gpt_oss", vocab_size=261)}


def test_sliced_reads_and_written_shards_match_in_memory_shards(targets, tmp_path):
    model = targets["gpt_oss"]
    hf = save_tiny_target(model, tmp_path / "hf")
    mapping = Mapping(2, moe_tp_size=2)
    out = write_tp_shards(hf, tmp_path / "tp2", mapping)
    assert is_presharded(out) and not is_presharded(hf)
    assert read_mapping(out) == mapping
    full = model.state_dict()
    for rank in range(2):
        sliced = load_rank_state(hf, model.config, mapping, rank)
        stored = load_presharded_rank(out, rank)
        assert set(sliced) == set(stored) == set(full)
        for name, tensor in full.items():
            expect = shard_tensor(name, tensor, Dims.of(model.config), mapping, rank)
            assert torch.equal(sliced[name], expect) and torch.equal(stored[name], expect), name
    with pytest.raises(ConfigError):
        write_tp_shards(hf, tmp_path / "tp3", 3)
    assert not (tmp_path / "tp3").exists()
