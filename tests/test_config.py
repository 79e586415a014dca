"""PrismeConfig: presets validate, JSON round-trips, derived sizes, parameter counts, and bad configs raise."""

from __future__ import annotations

import pytest
import torch

from prisme.config import PRESETS, PrismeConfig
from prisme.model.backbone import Backbone


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_validates(name):
    """Each named preset builds and passes validate()."""
    cfg = PrismeConfig.from_name(name)
    assert cfg.validate() is cfg
    assert cfg.name == name


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_json_round_trip_gives_an_equal_config(name, tmp_path):
    """to_json -> from_json (as a string and as a file) reproduces the config field for field."""
    cfg = PrismeConfig.from_name(name)
    assert PrismeConfig.from_json(cfg.to_json()) == cfg
    path = tmp_path / "config.json"
    cfg.to_json(path)
    assert PrismeConfig.from_json(path) == cfg
    assert PrismeConfig.from_dict(cfg.to_dict()) == cfg


def test_prisme_103m_derived_fields_match_the_spec():
    """prisme_103m derives A=24, STOP=24, DENSE=25, F=4w+49, h_e=768, h_ff=2048 and GQA 12/3 with a tied head."""
    cfg = PrismeConfig.from_name("prisme_103m")
    assert cfg.n_actions == 24
    assert (cfg.stop_action, cfg.dense_action) == (24, 25)
    assert cfg.controller_features == 4 * 256 + 49 == 1073
    assert cfg.editor_hidden == 768
    assert cfg.ffn_hidden == 2048
    assert (cfg.n_head, cfg.n_kv_head, cfg.head_dim) == (12, 3, 64)
    assert cfg.n_ws_heads == 4
    assert cfg.tie_embeddings is True
    assert cfg.cost_context == 512


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_derived_action_ids_and_controller_features_follow_the_formulas(name):
    """A = M + M/2, STOP = A, DENSE = A + 1 and F = 4w + M + A + r_max + 1 (+ 2 bank-match features with
    controller_bank) for every preset."""
    cfg = PrismeConfig.from_name(name)
    M = cfg.n_slots
    assert cfg.n_actions == M + M // 2
    assert cfg.stop_action == cfg.n_actions
    assert cfg.dense_action == cfg.n_actions + 1
    assert cfg.controller_features == 4 * cfg.w + M + cfg.n_actions + cfg.r_max + 1 + 2 * cfg.controller_bank


def test_gpt2_family_defaults_to_an_untied_head_biases_and_a_4x_mlp():
    """seed001 (gpt2-style) derives ffn_hidden = 4d, biases on, head untied, and no workspace."""
    cfg = PrismeConfig.from_name("seed001")
    assert cfg.ffn_hidden == 4 * cfg.d_model == 256
    assert cfg.use_bias and not cfg.tie_embeddings and not cfg.use_workspace
    assert (cfg.vocab_size, cfg.n_layer, cfg.d_model, cfg.n_head, cfg.head_dim, cfg.max_seq_len) == (97, 2, 64, 4, 16,
                                                                                                      512)


def test_seed001_backbone_has_exactly_145280_parameters():
    """The seed001 preset reproduces seed 001's model size: 145,280 parameters."""
    assert Backbone(PrismeConfig.from_name("seed001")).num_parameters() == 145_280


@pytest.mark.parametrize("name, expected", [("prisme_103m", 99_502_848), ("prisme_459m", 446_744_064)])
def test_big_backbones_have_the_spec_parameter_counts_on_meta(name, expected):
    """prisme_103m and prisme_459m backbones (tied head) count 99,502,848 and 446,744,064 parameters."""
    with torch.device("meta"):
        model = Backbone(PrismeConfig.from_name(name))
    assert all(p.is_meta for p in model.parameters())
    assert model.num_parameters() == expected


@pytest.mark.parametrize("overrides, field", [
    (dict(d_model=30), "d_model"),  # 30 is not divisible by 4 heads
    (dict(n_kv_head=3), "n_kv_head"),  # 4 heads are not divisible by 3 kv heads
    (dict(n_slots=5), "n_slots"),
    (dict(ws_head_dim=24), "ws_head_dim"),  # w=32
    (dict(r_max=0), "r_max"),
    (dict(family="bert"), "family"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(n_layer=1.5), "n_layer"),
    (dict(ws_init="xavier"), "ws_init"),
])
def test_bad_field_raises_value_error_naming_it(overrides, field):
    """Every bad field or combination gives a ValueError whose message names the field."""
    with pytest.raises(ValueError, match=field):
        PrismeConfig.from_name("tiny", **overrides)


def test_unknown_preset_raises_value_error_listing_the_presets():
    """from_name of an unknown preset is a ValueError that names it and lists the known ones."""
    with pytest.raises(ValueError, match=r"unknown preset 'nope'.*tiny"):
        PrismeConfig.from_name("nope")


def test_unknown_key_in_from_dict_raises_value_error_naming_it():
    """from_dict rejects a key that is not a PrismeConfig field, naming it."""
    d = PrismeConfig.from_name("tiny").to_dict()
    d["n_layers"] = 3
    with pytest.raises(ValueError, match="n_layers"):
        PrismeConfig.from_dict(d)


def test_non_json_config_raises_value_error(tmp_path):
    """from_json of text that is not a JSON object raises ValueError, from a string and from a file."""
    with pytest.raises(ValueError, match="not valid JSON"):
        PrismeConfig.from_json('{"d_model": 64,')
    for text, match in [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ("", "not valid JSON")]:
        path = tmp_path / "bad.json"
        path.write_text(text)
        with pytest.raises(ValueError, match=match):
            PrismeConfig.from_json(path)
