"""Checkpoints: bitwise round trip, atomic writes, and a clear ValueError for every malformed checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from prisme import checkpoint as ckpt
from prisme.config import PrismeConfig
from prisme.model.prisme import PrismeModel


def _model(cfg: PrismeConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> PrismeModel:
    torch.manual_seed(seed)
    return PrismeModel(cfg).to(dtype)


def _save(model: PrismeModel, run: Path, step: int = 1, **kw) -> Path:
    return ckpt.save_checkpoint(run / ckpt.checkpoint_name(step), model, ckpt.TrainingState("backbone", step, **kw))


def _tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of tensors that differ (bitwise) between two state dicts."""
    assert a.keys() == b.keys()
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_round_trip_is_bitwise(tiny_cfg, tmp_path, dtype):
    """Saved then loaded weights equal the originals bit for bit, in their own dtype, with the same logits."""
    model = _model(tiny_cfg, dtype=dtype)
    for p in model.parameters():  # move every tensor off its init value (U is zero-initialised)
        p.data.add_(torch.randn_like(p) * 0.01)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randint(0, 64, (2, 8))).logits.sum().backward()
    opt.step()
    path = _save(model, tmp_path, optimizer_state=opt.state_dict(), metrics={"loss": 1.5}, extra={"k": 2})
    loaded, meta = ckpt.load_checkpoint(tmp_path)  # the run folder resolves through `latest`
    assert meta.path == path and meta.step == 1 and meta.stage == "backbone"
    assert meta.metrics == {"loss": 1.5} and meta.extra == {"k": 2}
    assert _tensors_equal(model.state_dict(), loaded.state_dict()) == []
    x = torch.randint(0, 64, (2, 8))
    assert torch.equal(model.eval()(x).logits, loaded(x).logits)
    saved_opt = meta.optimizer_state["state"]
    assert all(torch.equal(saved_opt[i]["exp_avg"], opt.state_dict()["state"][i]["exp_avg"]) for i in saved_opt)
    # negative control: the comparison sees a one-ulp change in one weight
    with torch.no_grad():
        w = loaded.backbone.tok_emb.weight
        w[0, 0] = torch.nextafter(w[0, 0], torch.tensor(float("inf"), dtype=w.dtype))
    assert _tensors_equal(model.state_dict(), loaded.state_dict()) == ["backbone.tok_emb.weight"]


def test_crash_during_save_keeps_previous_checkpoint(tiny_cfg, tmp_path, monkeypatch):
    """A save that dies half-way leaves no checkpoint folder behind and `latest` on the previous checkpoint."""
    model = _model(tiny_cfg)
    first = _save(model, tmp_path, step=1, optimizer_state={"a": 1})

    def die(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", die)
    with pytest.raises(OSError, match="disk full"):
        _save(model, tmp_path, step=2, optimizer_state={"a": 2})
    # no ckpt_000002 and no temporary folders
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([ckpt.LATEST, first.name])
    assert ckpt.latest_checkpoint(tmp_path) == first
    assert ckpt.load_model(tmp_path)[1].step == 1
    # negative control: the same save without the failure does create step 2 and moves `latest`
    monkeypatch.undo()
    _save(model, tmp_path, step=2, optimizer_state={"a": 2})
    assert ckpt.latest_checkpoint(tmp_path).name == "ckpt_000002"


def test_resaving_a_step_replaces_the_folder(tiny_cfg, tmp_path):
    """Saving the same step twice replaces the folder in one rename and leaves no temporary folders."""
    _save(_model(tiny_cfg, seed=0), tmp_path, step=3)
    _save(_model(tiny_cfg, seed=1), tmp_path, step=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt_000003", ckpt.LATEST]
    loaded, _ = ckpt.load_model(tmp_path)
    assert _tensors_equal(loaded.state_dict(), _model(tiny_cfg, seed=1).state_dict()) == []


def test_truncated_weights_are_a_clear_error(tiny_cfg, tmp_path):
    """A truncated model.safetensors is a ValueError naming the file, with or without the sha256 check."""
    path = _save(_model(tiny_cfg), tmp_path)
    ckpt.load_model(path)  # negative control: the intact file loads
    data = (path / ckpt.WEIGHTS).read_bytes()
    (path / ckpt.WEIGHTS).write_bytes(data[: len(data) // 2])
    for verify in (True, False):
        with pytest.raises(ValueError, match=r"model\.safetensors.*(truncated or corrupt)"):
            ckpt.load_checkpoint(path, verify=verify)


def test_flipped_byte_is_caught_by_the_checksum(tiny_cfg, tmp_path):
    """One flipped byte inside the weights (still a parsable file) fails the sha256 check."""
    path = _save(_model(tiny_cfg), tmp_path)
    data = bytearray((path / ckpt.WEIGHTS).read_bytes())
    data[-3] ^= 0x01
    (path / ckpt.WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        ckpt.load_model(path)
    ckpt.load_checkpoint(path, verify=False)  # negative control: without the check the damage goes unnoticed


@pytest.mark.parametrize("name", [ckpt.WEIGHTS, ckpt.CONFIG, ckpt.STATE])
def test_missing_file_is_named(tiny_cfg, tmp_path, name):
    """A checkpoint folder missing one of its files is a ValueError naming that file."""
    path = _save(_model(tiny_cfg), tmp_path)
    (path / name).unlink()
    with pytest.raises(ValueError, match=f"missing .*{name}"):
        ckpt.load_model(path)


def test_missing_path_is_a_clear_error(tmp_path):
    """A path that does not exist is a ValueError saying so."""
    with pytest.raises(ValueError, match="does not exist"):
        ckpt.load_model(tmp_path / "nope")


def test_checkpoint_of_another_config_is_rejected(tiny_cfg, tmp_path):
    """Loading with another expected config, or weights under another config.json, is a ValueError."""
    path = _save(_model(tiny_cfg), tmp_path)
    other = tiny_cfg.replace(n_layer=3)
    with pytest.raises(ValueError, match="another model config.*n_layer"):
        ckpt.load_checkpoint(path, expected_config=other)
    ckpt.load_checkpoint(path, expected_config=tiny_cfg)  # negative control: the right config loads
    (path / ckpt.CONFIG).write_text(other.to_json())
    with pytest.raises(ValueError, match="another config"):
        ckpt.load_model(path)


def test_schema_version_mismatch_is_rejected(tiny_cfg, tmp_path):
    """A checkpoint with another schema version is a ValueError naming both versions."""
    path = _save(_model(tiny_cfg), tmp_path)
    state = json.loads((path / ckpt.STATE).read_text())
    state["schema_version"] = ckpt.SCHEMA_VERSION + 1
    (path / ckpt.STATE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match=f"schema version {ckpt.SCHEMA_VERSION + 1}.*reads version "
                                         f"{ckpt.SCHEMA_VERSION}"):
        ckpt.load_model(path)


def test_corrupt_state_and_optimizer_are_clear_errors(tiny_cfg, tmp_path):
    """Unparsable state.json or optimizer.pt is a ValueError naming the file (a damaged optimizer.pt fails its
    recorded checksum first; unverified, it fails to unpickle)."""
    path = _save(_model(tiny_cfg), tmp_path, optimizer_state={"x": torch.zeros(3)})
    (path / ckpt.OPTIMIZER).write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match=r"optimizer\.pt does not match the sha256"):
        ckpt.load_checkpoint(path)
    with pytest.raises(ValueError, match=r"optimizer\.pt is truncated or corrupt"):
        ckpt.load_checkpoint(path, verify=False)
    ckpt.load_checkpoint(path, load_optimizer=False)  # negative control: the weights alone still load
    (path / ckpt.STATE).write_text("{not json")
    with pytest.raises(ValueError, match=r"state\.json is not valid JSON"):
        ckpt.load_model(path)


def test_prune_keeps_the_newest_folders(tiny_cfg, tmp_path):
    """`prune_checkpoints` keeps the newest `keep_last` folders and `latest` names the newest."""
    model = _model(tiny_cfg)
    for step in (1, 2, 3):
        _save(model, tmp_path, step=step)
        ckpt.prune_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt_*")) == ["ckpt_000002", "ckpt_000003"]
    assert ckpt.read_meta(tmp_path).step == 3


def test_rng_state_round_trips_through_json():
    """A generator state encoded for state.json decodes to the same stream of numbers."""
    g = torch.Generator().manual_seed(7)
    torch.randn(5, generator=g)
    text = json.loads(json.dumps(ckpt.encode_rng(g.get_state())))
    expected = torch.randn(4, generator=g)
    h = torch.Generator()
    h.set_state(ckpt.decode_rng(text))
    assert torch.equal(torch.randn(4, generator=h), expected)
    assert not torch.equal(torch.randn(4, generator=torch.Generator().manual_seed(7)), expected)  # negative control


def test_run_folder_without_latest_falls_back_to_the_newest_complete_checkpoint(tiny_cfg, tmp_path):
    """With `latest` gone, a run folder resolves to its newest complete ckpt_* folder (an incomplete one is skipped)."""
    model = _model(tiny_cfg)
    for step in (1, 2, 3):
        _save(model, tmp_path, step=step)
    (tmp_path / ckpt.LATEST).unlink()
    (tmp_path / "ckpt_000003" / ckpt.WEIGHTS).unlink()
    assert ckpt.read_meta(tmp_path).step == 2
    for step in (1, 2):  # negative control: nothing complete left -> the clear missing-file error
        (tmp_path / f"ckpt_00000{step}" / ckpt.CONFIG).unlink()
    with pytest.raises(ValueError, match="missing"):
        ckpt.read_meta(tmp_path)


# ---------------------------------------------------------------------- a checkpoint from before the package layout
FLAT = Path(__file__).parent / "data" / "flat_layout_checkpoint"


def test_a_checkpoint_saved_by_the_flat_layout_loads_and_computes_the_same_logits():
    """tests/data/flat_layout_checkpoint was saved by prisme 0.1.0 when every module sat in prisme/ (and before
    `slot_kv_cache` existed): it loads through the public face and gives the logits and controller trace stored
    beside it, to float32 rounding. Negative control: the same architecture with other weights is far off."""
    import json

    import prisme

    expected = json.loads((FLAT / "expected.json").read_text())
    model, meta = prisme.load_model(FLAT / "ckpt_00000007")
    assert meta.stage == "workspace" and meta.step == 7 and not model.editor.run.slot_kv
    tokens, actions = torch.tensor(expected["tokens"]), torch.tensor(expected["actions"])
    want = torch.tensor(expected["logits"], dtype=torch.float64)
    with torch.no_grad():
        got = model.eval()(tokens, actions).logits.double()
        policy = model.forward_policy(tokens, 2, lambda_cost=0.0).actions
        other = prisme.PrismeModel(model.cfg).eval()
        far = other(tokens, actions).logits.double()
    assert float((got - want).abs().max()) < 1e-5
    assert policy.tolist() == expected["policy_actions"]
    assert float((far - want).abs().max()) > 1e-2


# ---------------------------------------------------------------------- fields that moved out of PrismeConfig
def _written_before_the_move(tmp_path: Path, **old) -> tuple[PrismeModel, Path]:
    """A float64 router model whose bank reads the embeddings, saved, with its config.json holding the fields that
    have since left PrismeConfig (`old`), as a checkpoint written before they moved holds them."""
    from tiny_models import tiny_model

    model = tiny_model(0, bank_source="embedding", query_source="embedding", bank_shift=True, router=True)
    path = _save(model, tmp_path)
    d = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**d, **old}))
    return model, path


def _decoded(model: PrismeModel, tokens: torch.Tensor, **policy) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Logits and traces of a chunked decode (the model's default decode options), and generation's ops per token."""
    from prisme.decoding.generate import generate
    from prisme.model.policy import Controller

    st = model.new_decode_state(tokens.shape[0], 24)
    outs = [st.prefill(tokens[:, :5], logits="all", policy=Controller(2, **policy))]
    outs += [st.decode_step(tokens[:, i:i + 1], policy=Controller(2, **policy)) for i in range(5, tokens.shape[1])]
    ops = generate(model, tokens[:1, :6].tolist(), 8, policy=Controller(2, **policy)).ops[0]
    return torch.cat([o.logits for o in outs], 1), torch.cat([o.actions for o in outs], 1), ops


def test_a_checkpoint_written_before_decode_options_and_prices_moved_decodes_as_it_did(tmp_path, monkeypatch):
    """An older config.json holding `bank_tables`, `bank_store`, `lambda_cost` and `kappa_risk` loads: the decode
    options become the model's `decode_options` and the prices its `default_price`, so that it decodes (float64,
    bitwise) and prices exactly as the same weights given those options and prices explicitly. The fields at their
    old defaults load as a config without them. Negative control: a reader that drops the moved fields decodes and
    prices otherwise."""
    from prisme.config import MOVED_CONFIG_FIELDS
    from prisme.model.policy import Price
    from prisme.options import DecodeOptions

    old = dict(bank_tables=True, bank_store="ids", lambda_cost=0.05, kappa_risk=0.1)
    model, path = _written_before_the_move(tmp_path / "moved", **old)
    assert ckpt.read_meta(path).moved == old
    loaded, _ = ckpt.load_model(path)
    assert loaded.decode_options == DecodeOptions(bank_tables=True, bank_store="ids")
    assert loaded.default_price == Price(lambda_cost=0.05, kappa_risk=0.1)
    explicit = PrismeModel(model.cfg, DecodeOptions(bank_tables=True, bank_store="ids")).double().eval()
    explicit.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 64, (3, 20), generator=torch.Generator().manual_seed(3))
    want = _decoded(explicit, tokens, lambda_cost=0.05, kappa_risk=0.1)
    got = _decoded(loaded, tokens)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]) and got[2] == want[2]
    assert loaded.new_decode_state(1).bank.KV is None  # the ids alone
    _, plain = _written_before_the_move(tmp_path / "defaults", **MOVED_CONFIG_FIELDS)
    assert ckpt.read_meta(plain).moved == {} and ckpt.load_model(plain)[0].decode_options == DecodeOptions()
    monkeypatch.setattr(ckpt, "moved_fields", lambda d: ({k: v for k, v in d.items() if k not in old}, {}))
    dropped, _ = ckpt.load_model(path)
    lost = _decoded(dropped, tokens)
    assert not torch.equal(lost[1], want[1]) and lost[2] != want[2]
    with pytest.raises(ValueError, match="lambda_cost"):  # the config alone cannot hold them
        PrismeConfig.from_dict({**model.cfg.to_dict(), **old})


def test_a_checkpoint_written_with_the_slot_kv_cache_runs_with_it(tmp_path, monkeypatch):
    """An older config.json holding `slot_kv_cache=True` loads into a model whose editor keeps the slot K/V cache, as
    the same weights given `ExecutionOptions(slot_kv_cache=True)`: its rollouts carry a `SlotKV`, the matmul ops
    counted on a forced pass and the logits equal the explicit option's (bitwise), and so do decoding's logits,
    traces and generation's ops per token (the cost model's slot K/V column). Negative control: a reader that drops
    the field loads a model that recomputes every slot's K/V (no SlotKV, other counted ops)."""
    from prisme.costs.counting import OpsCounter
    from prisme.model.editor import SlotKV
    from prisme.options import ExecutionOptions

    model, path = _written_before_the_move(tmp_path / "kv", slot_kv_cache=True)
    assert ckpt.read_meta(path).moved == {"slot_kv_cache": True}
    loaded, _ = ckpt.load_model(path)
    assert loaded.execution == ExecutionOptions(slot_kv_cache=True) and loaded.editor.run.slot_kv
    explicit = PrismeModel(model.cfg, execution=ExecutionOptions(slot_kv_cache=True)).double().eval()
    explicit.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 64, (2, 20), generator=torch.Generator().manual_seed(4))
    actions = torch.randint(0, model.cfg.n_actions, (2, 20, 2), generator=torch.Generator().manual_seed(5))

    def forced(m: PrismeModel) -> tuple[torch.Tensor, dict[str, int], list]:
        with torch.no_grad(), OpsCounter(m) as oc:
            out = m(tokens, actions, return_state=True)
        return out.logits, dict(oc.by_component), [info.slot_kv for info in out.infos]

    got, want = forced(loaded), forced(explicit)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    assert all(isinstance(kv, SlotKV) for kv in got[2] + want[2])
    dec_got, dec_want = _decoded(loaded, tokens), _decoded(explicit, tokens)
    assert torch.equal(dec_got[0], dec_want[0]) and torch.equal(dec_got[1], dec_want[1]) and dec_got[2] == dec_want[2]
    monkeypatch.setattr(ckpt, "moved_fields", lambda d: ({k: v for k, v in d.items() if k != "slot_kv_cache"}, {}))
    dropped, _ = ckpt.load_model(path)
    lost = forced(dropped)
    assert not dropped.editor.run.slot_kv and all(kv is None for kv in lost[2])
    assert lost[1] != want[1] and lost[1]["editor_slot_attn"] != want[1]["editor_slot_attn"]
