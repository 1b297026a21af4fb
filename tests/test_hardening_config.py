"""Issue 21, configs: every field type- and range-checked, errors naming the field and the file."""

from __future__ import annotations

import json
import math

import pytest
from test_dims import DEEPSEEK_V3_CONFIG

from mla_backends.core.dims import MLADims, read_config_json

YARN = DEEPSEEK_V3_CONFIG["rope_scaling"]

BAD_FIELDS = [  # (override, exception, field named in the message)
    ({"num_attention_heads": 16.7}, ValueError, "config.num_attention_heads"),
    ({"num_attention_heads": True}, TypeError, "config.num_attention_heads"),
    ({"kv_lora_rank": "512"}, TypeError, "config.kv_lora_rank"),
    ({"num_hidden_layers": "61"}, TypeError, "config.num_hidden_layers"),
    ({"max_position_embeddings": -1}, ValueError, "config.max_position_embeddings"),
    ({"rope_theta": 0}, ValueError, "config.rope_theta"),
    ({"rope_theta": -10000.0}, ValueError, "config.rope_theta"),
    ({"rms_norm_eps": -1}, ValueError, "config.rms_norm_eps"),
    ({"rms_norm_eps": "1e-6"}, TypeError, "config.rms_norm_eps"),
    ({"rope_interleave": "false"}, TypeError, "config.rope_interleave"),
    ({"rope_scaling": "yarn"}, TypeError, "config.rope_scaling"),
    ({"rope_scaling": dict(YARN, factor=math.nan)}, ValueError, "config.rope_scaling.factor"),
    ({"rope_scaling": dict(YARN, factor=math.inf)}, ValueError, "config.rope_scaling.factor"),
    ({"rope_scaling": dict(YARN, factor="40")}, TypeError, "config.rope_scaling.factor"),
    ({"rope_scaling": dict(YARN, original_max_position_embeddings=4096.5)}, ValueError,
     "config.rope_scaling.original_max_position_embeddings"),
    ({"rope_parameters": ["yarn"]}, TypeError, "config.rope_parameters"),
    ({"indexer_rope_interleave": "false", "index_topk": 2048}, TypeError, "config.indexer_rope_interleave"),
    ({"index_topk": 2048.5}, ValueError, "config.index_topk"),
]


IDS = [b[2] + "=" + repr(next(iter(b[0].values())))[:20] for b in BAD_FIELDS]


@pytest.mark.parametrize(("override", "exc", "field"), BAD_FIELDS, ids=IDS)
def test_config_fields_are_type_and_range_checked_naming_field_and_file(tmp_path, override, exc, field):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dict(DEEPSEEK_V3_CONFIG, **override)))
    with pytest.raises(exc) as info:
        MLADims.from_hf_config(path)
    assert field + ":" in str(info.value) and str(path) in str(info.value), str(info.value)
    with pytest.raises(exc, match=field.replace(".", r"\.")):  # the same check for a dict
        MLADims.from_hf_config(dict(DEEPSEEK_V3_CONFIG, **override))


def test_config_files_that_are_not_a_json_object_name_the_file(tmp_path):
    listing = tmp_path / "list.json"
    listing.write_text("[1, 2]")
    with pytest.raises(TypeError, match="JSON list in .*list.json"):
        MLADims.from_hf_config(listing)
    broken = tmp_path / "broken" / "config.json"
    broken.parent.mkdir()
    broken.write_text('{"num_attention_heads": 128,')
    for read in (MLADims.from_hf_config, read_config_json):
        with pytest.raises(ValueError, match=r"config: got invalid JSON in .*broken/config\.json"):
            read(broken.parent)


def test_direct_construction_is_range_checked_too():
    for kwargs, exc, field in (({"rope_theta": 0.0}, ValueError, "rope_theta"),
                               ({"rms_norm_eps": math.nan}, ValueError, "rms_norm_eps"),
                               ({"max_position_embeddings": 0}, ValueError, "max_position_embeddings"),
                               ({"rope_interleave": "false"}, TypeError, "rope_interleave")):
        with pytest.raises(exc, match=f"MLADims.{field}"):
            MLADims(num_heads=16, **kwargs)
    good = MLADims.from_hf_config(dict(DEEPSEEK_V3_CONFIG, num_attention_heads=128.0))  # integral float is fine
    assert good.num_heads == 128


def test_attention_bias_must_be_a_bool():
    from mla_backends.loading.hf import hf_attention_bias

    with pytest.raises(TypeError, match="config.attention_bias: got str 'false'"):
        hf_attention_bias(dict(DEEPSEEK_V3_CONFIG, attention_bias="false"))
    assert hf_attention_bias(dict(DEEPSEEK_V3_CONFIG, attention_bias=True)) is True
