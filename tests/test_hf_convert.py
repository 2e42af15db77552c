"""Hugging Face config.json readings that changed between transformers versions."""

from __future__ import annotations

import json

import pytest
from transformers import LlamaConfig

from powerinfer.convert.hf import HFCheckpoint, llama_metadata


@pytest.mark.parametrize("layout", ["rope_parameters", "top level"])
@pytest.mark.parametrize("scaling", [None, 4.0])
def test_rope_base_and_scaling_from_either_config_layout(tmp_path, layout, scaling):
    """transformers >= 5 keeps rope_theta (and the scaling) under `rope_parameters`, older configs
    at the top level (`rope_scaling` for the scaling); a converter that misses one layout writes no
    or the default RoPE base. transformers' own reading of the same file is the reference."""
    rope = {"rope_type": "linear", "factor": scaling} if scaling else {"rope_type": "default"}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 32, "max_position_embeddings": 512}
    if layout == "rope_parameters":
        config["rope_parameters"] = {"rope_theta": 123456.0, **rope}
    else:
        config["rope_theta"] = 123456.0
        if scaling:
            config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    reference = LlamaConfig.from_pretrained(tmp_path).rope_parameters
    _, meta = llama_metadata(HFCheckpoint.open(tmp_path))
    assert meta["llama.rope.freq_base"] == reference["rope_theta"] == 123456.0
    if scaling:
        assert meta["llama.rope.scaling.type"] == reference["rope_type"] == "linear"
        assert meta["llama.rope.scaling.factor"] == reference["factor"] == scaling
    else:
        assert "llama.rope.scaling.type" not in meta and reference["rope_type"] == "default"
