"""Config parsing: every field honoured or refused, bad values named, z-lab and HF layouts, generation_config."""

from __future__ import annotations

import dataclasses
import json
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.config import ConfigError, ConfigWarning, DrafterConfig, TargetConfig, read_generation_config
from dflash_jax.models.drafter import draft_block, draft_logits, init_draft_cache, init_drafter

# A Qwen3.5-27B-shaped config.json in the official multimodal layout, every text field as the checkpoint has
# it (reference: Qwen3.6-27B config quoted in llama.cpp PR #22673; sizes shrunk where they do not matter).
REAL = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "image_token_id": 248056,
    "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
    "vision_config": {"depth": 27, "hidden_size": 1152, "model_type": "qwen3_5"},
    "text_config": {
        "model_type": "qwen3_5_text", "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True,
        "dtype": "bfloat16", "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256,
        "hidden_act": "silu", "hidden_size": 5120, "initializer_range": 0.02, "intermediate_size": 17408,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"], "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
        "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
        "mlp_only_layers": [], "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": 24, "num_hidden_layers": 4, "num_key_value_heads": 4, "output_gate_type": "swish",
        "rms_norm_eps": 1e-06, "use_cache": True, "vocab_size": 248320, "pad_token_id": None,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "rope_type": "default",
                            "rope_theta": 10000000, "partial_rotary_factor": 0.25},
    },
}


def _text(**over):
    raw = json.loads(json.dumps(REAL))
    raw["text_config"].update(over)
    return raw


def test_real_layout_parses_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = TargetConfig.from_hf(REAL)
    assert (cfg.rope_theta, cfg.rotary_dim, cfg.max_position_embeddings) == (1e7, 64, 262144)
    assert (cfg.eos_token_ids, cfg.mtp_num_hidden_layers, cfg.rope_scaling.rope_type) == ((248044,), 1, "default")


def test_transformers_defaults_for_missing_fields():
    """Absent rope_theta / max_position_embeddings / partial_rotary_factor: what transformers' config uses."""
    transformers = pytest.importorskip("transformers")
    raw = _text()
    for key in ("rope_parameters", "max_position_embeddings"):
        del raw["text_config"][key]
    cfg = TargetConfig.from_hf(raw)
    hf = transformers.Qwen3_5TextConfig()
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 10000.0
    assert cfg.partial_rotary_factor == hf.rope_parameters["partial_rotary_factor"]
    assert cfg.max_position_embeddings == hf.max_position_embeddings


@pytest.mark.parametrize("over, message", [
    (dict(hidden_size=0), "hidden_size must be an integer >= 1, got 0"),
    (dict(num_attention_heads=-4), "num_attention_heads must be an integer >= 1, got -4"),
    (dict(vocab_size=None), "missing required field 'text_config.vocab_size'"),
    (dict(head_dim=2.5), r"text_config.head_dim must be an integer >= 1, got 2.5"),
    (dict(intermediate_size="big"), "intermediate_size must be an integer >= 0"),
    (dict(rms_norm_eps=0), "rms_norm_eps must be a finite number > 0, got 0"),
    (dict(rms_norm_eps=-1e-6), "rms_norm_eps must be a finite number > 0"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be an integer >= 1"),
    (dict(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1 is not supported"),
    (dict(attn_output_gate=False), "attn_output_gate=False is not supported"),
    (dict(mamba_ssm_dtype="bfloat16"), "mamba_ssm_dtype='bfloat16' is not supported"),
    (dict(mtp_use_dedicated_embeddings=True), "mtp_use_dedicated_embeddings=True is not supported"),
    (dict(output_gate_type="sigmoid"), "output_gate_type='sigmoid' is not supported"),
    (dict(sliding_window=4096), "sliding_window=4096 is not supported"),
    (dict(use_sliding_window=True), "use_sliding_window=True is not supported"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False is not supported"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step=2 is not supported"),
    (dict(mlp_only_layers=[0]), r"mlp_only_layers=\[0\] is not supported"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, shiny=1)),
     r"rope_parameters fields \['shiny'\] are not understood"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantized checkpoints are not supported"),
    (dict(eos_token_id=[1, "x"]), "eos_token_id must be a token id or a list of them"),
    (dict(eos_token_id=248320), r"eos_token_id \[248320\] outside the vocabulary"),
    (dict(layer_types="full"), "layer_types must be a list"),
    (dict(rope_parameters=[1]), "rope_parameters must be an object"),
])
def test_target_refusals_name_the_field(over, message):
    with pytest.raises(ConfigError, match=message):
        TargetConfig.from_hf(_text(**over))


def test_unknown_fields_warn(recwarn):
    with pytest.warns(ConfigWarning, match=r"unknown text_config fields \['shiny_new_switch'\]"):
        TargetConfig.from_hf(_text(shiny_new_switch=True))


@pytest.mark.parametrize("content", ["[1, 2]", '"text"', "{not json"])
def test_config_json_that_is_not_an_object(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ConfigError, match=r"config.json: (config.json must be a JSON object|not valid JSON)"):
        TargetConfig.from_pretrained(tmp_path)


def test_generation_config_stop_ids(tmp_path):
    """Qwen3.5 lists <|im_end|> only in generation_config.json: it joins config.json's eos ids."""
    (tmp_path / "config.json").write_text(json.dumps(REAL))
    gen = {"bos_token_id": 248044, "do_sample": True, "eos_token_id": [248046, 248044], "pad_token_id": 248044,
           "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.57.0"}
    (tmp_path / "generation_config.json").write_text(json.dumps(gen))
    with pytest.warns(ConfigWarning, match=r"\['do_sample', 'temperature', 'top_k', 'top_p'\] are not applied"):
        cfg = TargetConfig.from_pretrained(tmp_path)
    assert cfg.eos_token_ids == (248044, 248046)
    greedy = {**gen, "do_sample": False}  # HF ignores the sampling knobs then, so do we, silently
    (tmp_path / "generation_config.json").write_text(json.dumps(greedy))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert read_generation_config(tmp_path).eos_token_ids == (248046, 248044)
    (tmp_path / "generation_config.json").write_text(json.dumps({**greedy, "repetition_penalty": 1.05}))
    with pytest.warns(ConfigWarning, match=r"\['repetition_penalty'\] are not applied"):
        read_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({**greedy, "eos_token_id": [-1]}))
    with pytest.raises(ConfigError, match="generation_config.json: eos_token_id must be a token id"):
        read_generation_config(tmp_path)


# ---------------------------------------------------------------- drafter

DRAFTER = dict(architectures=["DFlashDraftModel"], model_type="qwen3", hidden_size=32, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48, vocab_size=96,
               num_target_layers=4, rope_theta=10000.0, block_size=4,
               dflash_config=dict(mask_token_id=95, target_layer_ids=[0, 2]))


def test_zlab_layouts_agree():
    """block_size inside dflash_config, mask_token_id / target_layer_ids at the top level, rope_parameters:
    z-lab's _draft_value reads dflash_config first, then the top level."""
    base = DrafterConfig.from_hf(DRAFTER)
    inside = {k: v for k, v in DRAFTER.items() if k not in ("block_size", "rope_theta")}
    inside |= dict(dflash_config=dict(block_size=4, mask_token_id=95, target_layer_ids=[0, 2]),
                   rope_parameters=dict(rope_type="default", rope_theta=10000.0))
    top = {k: v for k, v in DRAFTER.items() if k != "dflash_config"} | dict(mask_token_id=95,
                                                                          target_layer_ids=[0, 2])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert DrafterConfig.from_hf(inside) == base == DrafterConfig.from_hf(top)
    # dflash_config wins over the top level, as in z-lab.
    both = DRAFTER | dict(dflash_config=dict(DRAFTER["dflash_config"], block_size=8))
    assert DrafterConfig.from_hf(both).block_size == 8


@pytest.mark.parametrize("over, message", [
    (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    (dict(attention_bias=True), "attention_bias=True is not supported"),
    (dict(attention_dropout=0.1), "attention_dropout=0.1 is not supported"),
    (dict(architectures=["DFlash2DraftModel"]), "missing required field 'conv_kernel_size'"),
    (dict(dflash_config=dict(mask_token_id=95, target_layer_ids=[0, 2], conv_kernel_size=4)),
     "missing required field 'conv_group_size'"),
    (dict(dflash_config=dict(mask_token_id=95, target_layer_ids=[0, 2], use_swa=True)),
     "dflash_config.use_swa=True is not supported"),
    (dict(dflash_config=dict(mask_token_id=95, target_layer_ids=[0, 2], attention_sink_bias=True)),
     "dflash_config.attention_sink_bias=True is not supported"),
    (dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor != 1"),
    (dict(hidden_size=0), "hidden_size must be an integer >= 1, got 0"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps must be a finite number > 0"),
    (dict(dflash_config=dict(mask_token_id=95, target_layer_ids=[0, 2], final_logit_softcapping=-1.0)),
     "final_logit_softcapping=-1.0 must be >= 0"),
    (dict(dflash_config=dict(mask_token_id=95, target_layer_ids="0,2")), "target_layer_ids must be a list"),
    (dict(layer_types=["sliding_attention"] * 2, sliding_window=8, use_sliding_window=False),
     "use_sliding_window is false"),
])
def test_drafter_refusals(over, message):
    with pytest.raises(ConfigError, match=message):
        DrafterConfig.from_hf(DRAFTER | over)



@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_target_and_drafter_read_the_rope_alike(key):
    """Both parsers read ``rope_parameters`` (or the legacy ``rope_scaling``) through one reader: the same
    scaling and theta from the same object, and errors that name the key read with the path to it."""
    def configs(rope):
        target = _text(**{key: rope})
        if key == "rope_scaling":
            del target["text_config"]["rope_parameters"]
        return target, {**DRAFTER, key: rope}

    yarn = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=4096, rope_theta=1e6)
    target, drafter = configs(yarn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t, d = TargetConfig.from_hf(target), DrafterConfig.from_hf(drafter)
    assert t.rope_scaling == d.rope_scaling and (t.rope_theta, d.rope_theta) == (1e6, 1e6)
    assert (d.rope_scaling.rope_type, d.rope_scaling.factor, d.rope_scaling.original_max_position_embeddings) == (
        "yarn", 4.0, 4096)
    for rope, message in [({**yarn, "shiny": 1}, rf"{key} fields \['shiny'\] are not understood"),
                          ([1], f"{key} must be an object"),
                          ({**yarn, "rope_type": "dynamic"}, f"{key}.rope_type 'dynamic' is not supported")]:
        target, drafter = configs(rope)
        with pytest.raises(ConfigError, match=f"config.json: text_config.{message}"):
            TargetConfig.from_hf(target)
        with pytest.raises(ConfigError, match=f"config.json: {message}"):
            DrafterConfig.from_hf(drafter)


def test_a_config_that_is_not_a_drafter_is_refused():
    plain = {k: v for k, v in DRAFTER.items() if k not in ("dflash_config", "block_size")}
    with pytest.raises(ConfigError, match="not a DFlash drafter config"):
        DrafterConfig.from_hf(plain)


def test_logit_transforms_follow_zlab_compute_logits():
    """z-lab DFlashDraftModel.compute_logits: logits * output_multiplier, then tanh(l / cap) * cap."""
    raw = DRAFTER | dict(dflash_config=dict(DRAFTER["dflash_config"], output_multiplier=0.2,
                                            final_logit_softcapping=3.0, input_embedding_scale=2.0))
    cfg = DrafterConfig.from_hf(raw)
    assert DrafterConfig.from_hf(cfg.to_hf()) == cfg
    logits = np.random.default_rng(0).standard_normal((2, 3, 96)).astype(np.float32) * 40
    want = np.tanh(logits * 0.2 / 3.0) * 3.0
    np.testing.assert_allclose(np.asarray(draft_logits(cfg, jnp.asarray(logits))), want, rtol=1e-5, atol=1e-6)
    plain = DrafterConfig.from_hf(DRAFTER)
    np.testing.assert_array_equal(np.asarray(draft_logits(plain, jnp.asarray(logits))), logits)


def test_input_embedding_scale_scales_the_block():
    """z-lab: noise_embedding = embed(ids) * input_embedding_scale before the drafter."""
    cfg = DrafterConfig.from_hf(DRAFTER | dict(input_embedding_scale=3.0))
    plain = dataclasses.replace(cfg, input_embedding_scale=1.0)
    d = init_drafter(cfg, seed=3)
    x = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, 32)).astype(np.float32))
    cache = init_draft_cache(cfg, 1, 8, jnp.float32)
    got, _ = draft_block(d.module(), cache, x)
    want, _ = draft_block(init_drafter(plain, seed=3).module(), cache, x * 3.0)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- JSON types (issue 25)

@pytest.mark.parametrize("key, value", [
    ("tie_word_embeddings", "false"), ("tie_word_embeddings", 0), ("vocab_size", "248320"),
    ("rms_norm_eps", "1e-6"), ("mtp_num_hidden_layers", "1"), ("attention_bias", "false"),
    ("attn_output_gate", "true"), ("use_sliding_window", "false"), ("max_position_embeddings", "4096"),
])
def test_target_strings_for_json_types_are_refused_naming_field_and_file(tmp_path, key, value):
    """"false" would count as true by Python's truthiness (and drop lm_head.weight): refused, not read."""
    raw = _text(**{key: value}) if key != "tie_word_embeddings" else {**REAL, key: value}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'config.json'}: .*{key}.*{value!r}"):
        TargetConfig.from_pretrained(tmp_path)
    tied = TargetConfig.from_hf({**REAL, "tie_word_embeddings": True})
    assert tied.tie_word_embeddings is True


@pytest.mark.parametrize("over, field", [
    (dict(use_sliding_window="false", layer_types=["sliding_attention"] * 2, sliding_window=8), "use_sliding_window"),
    (dict(is_causal="false"), "is_causal"),
    (dict(dflash_config=dict(mask_token_id=95, target_layer_ids=[0, 2], causal="no")), "dflash_config.causal"),
    (dict(layer_types=["sliding_attention"] * 2, sliding_window="8", use_sliding_window=True), "sliding_window"),
    (dict(block_size="4"), "block_size"), (dict(rms_norm_eps="1e-6"), "rms_norm_eps"),
    (dict(dflash_config=dict(mask_token_id="95", target_layer_ids=[0, 2])), "mask_token_id"),
    (dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0, truncate="false")), "truncate"),
])
def test_drafter_strings_for_json_types_are_refused(tmp_path, over, field):
    (tmp_path / "config.json").write_text(json.dumps(DRAFTER | over))
    with pytest.raises(ConfigError, match=rf"config.json: .*{field}"):
        DrafterConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("key, value", [("do_sample", "false"), ("temperature", "0.6"), ("top_k", "20"),
                                        ("max_new_tokens", "x"), ("repetition_penalty", [1.0])])
def test_generation_config_strings_are_refused(tmp_path, key, value):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1, key: value}))
    with pytest.raises(ConfigError, match=rf"generation_config.json: {key} must be a JSON"):
        read_generation_config(tmp_path)


@pytest.mark.parametrize("layer_types", [[["linear_attention"]] * 4, [{"a": 1}] * 4, [None] * 4, [1, 2, 3, 4]])
def test_layer_types_entries_that_are_not_strings_are_refused(layer_types):
    with pytest.raises(ConfigError, match=r"layer_types\[0\] = .* is not a layer type"):
        TargetConfig.from_hf(_text(layer_types=layer_types))
    with pytest.raises(ConfigError, match=r"layer_types\[0\] = .* is not a layer type"):
        DrafterConfig.from_hf(DRAFTER | dict(layer_types=layer_types[:2]))


def test_drafter_block_size_one_is_refused_naming_file_and_field(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DRAFTER | dict(block_size=1)))
    with pytest.raises(ConfigError, match=r"config.json: block_size=1: .* needs block_size >= 2"):
        DrafterConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("key, value", [("is_dynamic", "false"), ("group_size", "32"), ("ch_axis", True)])
def test_quantization_config_strings_are_refused(key, value):
    from dflash_jax.config import QuantConfig

    qc = QuantConfig().to_hf()
    qc["global_quant_config"]["weight"][key] = value
    with pytest.raises(ConfigError, match=rf"x/config.json: quantization_config.global_quant_config.weight.{key}"):
        QuantConfig.from_hf({"quantization_config": qc}, "x/config.json")
