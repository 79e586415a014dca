"""The whole model in transformers: `prisme export-hf --workspace` writes a folder that
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` loads, whose logits are PRISME's for the
backbone path, the exported policy and forced actions (float32, 1e-5; they are PRISME's own modules), whose
`generate` gives `prisme.generate`'s greedy tokens, with its tokenizer and a model card."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from test_run_safety import run_cli

from prisme.checkpoint import TrainingState, save_checkpoint
from prisme.config import PrismeConfig
from prisme.data.tokenizers import ByteTokenizer
from prisme.decoding.generate import generate
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_full")
    torch.manual_seed(0)
    model = PrismeModel(PrismeConfig.from_name("tiny").replace(vocab_size=256, router=True)).eval()
    torch.nn.init.normal_(model.readout.U.weight, std=0.5)  # edits that move the logits
    save_checkpoint(root / "ck", model, TrainingState(
        stage="router", step=3, tokenizer=ByteTokenizer(), stage_config={"max_budget": 2, "dataset": "austen"},
        extra={"trained_groups": ["backbone", "workspace", "controller", "router"]}))
    rc, _ = run_cli("export-hf", "--checkpoint", str(root / "ck"), "--out", str(root / "hf"), "--workspace")
    assert rc == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", trust_remote_code=True).eval()
    return model, hf, root / "hf"


def test_the_exported_model_gives_prismes_logits(exported):
    model, hf, _ = exported
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    acts = torch.full((2, 12, 1), model.cfg.stop_action)
    acts[:, :, 0] = 3
    with torch.no_grad():
        policy = model.forward_policy(x, max_budget=2).logits
        assert float((hf(x).logits - policy).abs().max()) <= 1e-5  # the exported policy: budget 2
        assert float((hf(x, max_budget=0).logits - model(x).logits).abs().max()) <= 1e-5
        assert float((hf(x, actions=acts).logits - model(x, acts).logits).abs().max()) <= 1e-5
        assert float((policy - model(x).logits).abs().max()) > 1e-3  # control: the edits do change the logits


def test_the_exported_model_generates_prismes_greedy_tokens(exported):
    model, hf, _ = exported
    prompt = [list(b"It is a"), list(b"Emma W")]
    want = generate(model, prompt, 4, policy=Controller(max_budget=2)).tokens
    with torch.no_grad():
        got = [hf.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False)[0, len(p):].tolist() for p in prompt]
    assert got == want


def test_the_folder_has_its_tokenizer_and_a_model_card(exported):
    _, _, folder = exported
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert tok("naïve")["input_ids"] == list("naïve".encode())
    card = (folder / "README.md").read_text()
    assert "budget 2" in card and "ops per token" in card and "trust_remote_code=True" in card


def test_a_backbone_with_a_key_shift_and_a_window_exports_exactly(tmp_path, capsys):
    """`export-hf --workspace` ships PRISME's own modules, so a backbone with `key_shift` and `attn_window` (which a
    stock HF Llama cannot hold: `export-hf` without --workspace refuses it) gives the same logits there."""
    torch.manual_seed(0)
    cfg = PrismeConfig.from_name("tiny").replace(vocab_size=256, key_shift=True, attn_window=4)
    model = PrismeModel(cfg).eval()
    torch.nn.init.normal_(model.readout.U.weight, std=0.5)
    save_checkpoint(tmp_path / "ck", model, TrainingState(
        stage="workspace", step=1, tokenizer=ByteTokenizer(), stage_config={"max_budget": 2},
        extra={"trained_groups": ["backbone", "workspace"]}))
    rc, _ = run_cli("export-hf", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "hf"), "--workspace")
    assert rc == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", trust_remote_code=True).eval()
    assert hf.prisme.cfg.key_shift and hf.prisme.cfg.attn_window == 4
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert float((hf(x, max_budget=0).logits - model(x).logits).abs().max()) <= 1e-5
        plain = PrismeModel(cfg.replace(key_shift=False, attn_window=None)).eval()
        plain.load_state_dict({k: v for k, v in model.state_dict().items() if "wk_shift" not in k})
        assert float((hf(x, max_budget=0).logits - plain(x).logits).abs().max()) > 1e-3  # the options matter
    rc, _ = run_cli("export-hf", "--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "stock"))
    assert rc != 0 and "key_shift" in capsys.readouterr().err and not (tmp_path / "stock").exists()


# ---------------------------------------------------------------------- the export checks itself
@pytest.fixture(scope="module")
def unbounded(tmp_path_factory):
    """A router stage trained without an explicit max_budget (None: r_max), exported with --workspace."""
    root = tmp_path_factory.mktemp("hf_unbounded")
    torch.manual_seed(1)
    model = PrismeModel(PrismeConfig.from_name("tiny").replace(vocab_size=256, router=True)).eval()
    torch.nn.init.normal_(model.readout.U.weight, std=0.5)
    save_checkpoint(root / "ck", model, TrainingState(
        stage="router", step=3, tokenizer=ByteTokenizer(), stage_config={"max_budget": None, "dataset": "austen"},
        extra={"trained_groups": ["backbone", "workspace", "controller", "router"]}))
    rc, _ = run_cli("export-hf", "--checkpoint", str(root / "ck"), "--out", str(root / "hf"), "--workspace")
    assert rc == 0
    return model, root / "hf"


def load(folder, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **kw).eval()


def test_a_stage_without_an_explicit_max_budget_exports_at_r_max(unbounded):
    """`max_budget` null in the stage config means r_max (what the stage trained); the export used to fail with
    `int() ... NoneType`."""
    model, folder = unbounded
    assert json.loads((folder / "config.json").read_text())["policy"]["max_budget"] == model.cfg.r_max


def test_the_exports_weights_follow_the_umask(unbounded, exported, tmp_path):
    """model.safetensors was written 0600 (safetensors' own mode) by both exports; now 0666 minus the umask."""
    mask = os.umask(0)
    os.umask(mask)
    rc, _ = run_cli("export-hf", "--checkpoint", str(exported[2].parent / "ck"), "--out", str(tmp_path / "bb"))
    assert rc == 0
    for folder in (unbounded[1], exported[2], tmp_path / "bb"):
        assert (folder / "model.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask, folder


def edited(folder, tmp_path, change):
    out = tmp_path / "edited"
    shutil.copytree(folder, out)
    cfg = json.loads((out / "config.json").read_text())
    change(cfg, out)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def _cut(cfg, out):
    data = (out / "model.safetensors").read_bytes()
    (out / "model.safetensors").write_bytes(data[:len(data) // 2])


@pytest.mark.parametrize("change, named", [
    (lambda c, o: c["prisme"].pop("router"), "prisme.router is missing"),
    (lambda c, o: c["prisme"].update(n_layer=3), "prisme.n_layer is 3 (exported: 2)"),
    (lambda c, o: c["prisme"].update(d_model=48), "prisme.d_model is 48"),
    (lambda c, o: c["prisme"].update(new_field=1), "prisme.new_field was not exported"),
    (lambda c, o: c.pop("policy"), "policy is missing"),
    (lambda c, o: c["policy"].update(max_budget=1), "policy.max_budget is 1"),
    (lambda c, o: c["policy"].pop("lambda_cost"), "policy.lambda_cost is missing"),
    (lambda c, o: c.pop("prisme"), "prisme is missing"),
    (lambda c, o: c.pop("vocab_size"), "vocab_size is missing"),
    (_cut, "model.safetensors is truncated or corrupt")])
def test_an_edited_config_or_cut_weights_is_an_error_naming_it(unbounded, tmp_path, change, named):
    """With `router` removed the export loaded without the router, with `n_layer` changed at another depth, without
    `policy` as the backbone alone (transformers' "unexpected keys" table the only sign); each edit or removal, and
    a truncated weights file, is now a ValueError naming the entry or the file."""
    with pytest.raises(ValueError, match=re.escape(named)):
        load(edited(unbounded[1], tmp_path, change))


def test_weights_that_do_not_fit_and_an_edited_config_object_are_named(unbounded, tmp_path):
    """Weights with a tensor added or removed (the recorded config intact), and a config edited in Python and passed
    as `config=`: ValueErrors naming them; the untouched folder loads (control)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, folder = unbounded
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for name, ts in (("unexpected", {**tensors, "prisme.extra": torch.zeros(2)}),
                     ("missing", {k: v for k, v in tensors.items() if "router" not in k})):
        out = tmp_path / name
        shutil.copytree(folder, out)
        save_file(ts, str(out / "model.safetensors"), metadata=meta)
        with pytest.raises(ValueError, match=f"{name} keys"):
            load(out)
    cfg = transformers.AutoConfig.from_pretrained(folder, trust_remote_code=True)
    cfg.policy = {**cfg.policy, "max_budget": 0}
    with pytest.raises(ValueError, match="config passed to from_pretrained.*policy.max_budget is 0"):
        load(folder, config=cfg)
    assert load(folder).config.policy["max_budget"] == unbounded[0].cfg.r_max


def as_written_before_the_prices_moved(folder, out, **moved):
    """A copy of an export as `export-hf --workspace` wrote it while PrismeConfig still held `bank_tables`,
    `bank_store`, `lambda_cost` and `kappa_risk` (at their defaults, or at `moved`): in config.json's and the weights'
    record of the config, no kappa_risk in the policy, and that version's modeling code."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from prisme.config import MOVED_CONFIG_FIELDS
    from prisme.hf_full import RECORD, REMOTE

    shutil.copytree(folder, out)
    old = {**MOVED_CONFIG_FIELDS, **moved}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    for entries in (json.loads(meta[RECORD]), json.loads((out / "config.json").read_text())):
        entries["prisme"].update(old)
        entries["policy"].pop("kappa_risk")
        if "torch_dtype" in entries:
            (out / "config.json").write_text(json.dumps(entries))
        else:
            meta[RECORD] = json.dumps(entries, sort_keys=True)
    save_file(tensors, str(out / "model.safetensors"), metadata=meta)
    code = (REMOTE / "modeling_prisme.py.tmpl").read_text().splitlines(keepends=True)  # that version's forward:
    kap = [line for line in code if line.lstrip().startswith("kap = ")]  # no kappa_risk read, none passed
    assert len(kap) == 1 and sum(", kappa_risk=kap" in line for line in code) == 1
    (out / "modeling_prisme.py").write_text("".join(code).replace(kap[0], "").replace(", kappa_risk=kap", ""))
    return out


def test_an_export_written_before_the_prices_and_decode_options_moved_still_loads(unbounded, tmp_path):
    """An export whose config still holds the fields that left PrismeConfig, at the values every export had, loads
    (its own modeling code reading it with this prisme) and gives the same logits as a fresh export. Negative
    control: one holding a price that changed something is refused naming it, never silently run at another price."""
    model, folder = unbounded
    old = load(as_written_before_the_prices_moved(folder, tmp_path / "old"))
    x = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(old(x).logits, load(folder)(x).logits)
        assert float((old(x).logits - model.forward_policy(x, model.cfg.r_max).logits).abs().max()) <= 1e-5
    with pytest.raises(ValueError, match="kappa_risk"):
        load(as_written_before_the_prices_moved(folder, tmp_path / "priced", kappa_risk=0.5))


@pytest.mark.parametrize("side", ["left", "right"])
def test_a_padded_batch_gives_each_row_what_it_gets_alone(unbounded, side):
    """`attention_mask` was ignored: a padded row was continued differently from the same prompt alone. Now the
    logits at each row's tokens and `generate`'s tokens (left or right padding) are the row's alone, which are
    `prisme.generate`'s."""
    model, folder = unbounded
    hf = load(folder)
    prompts = [list(b"It is a"), list(b"Emma W"), list(b"x")]
    L = max(map(len, prompts))
    ids = torch.zeros(len(prompts), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        cols = slice(L - len(p), L) if side == "left" else slice(0, len(p))
        ids[i, cols], mask[i, cols] = torch.tensor(p), 1
    with torch.no_grad():
        batched = hf(ids, attention_mask=mask).logits
        for i, p in enumerate(prompts):
            alone = hf(torch.tensor([p])).logits[0]
            assert float((batched[i][mask[i].bool()] - alone).abs().max()) <= 1e-5
        got = hf.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                          eos_token_id=None)[:, L:].tolist()
        single = [hf.generate(torch.tensor([p]), max_new_tokens=4, do_sample=False, eos_token_id=None)[0, len(p):]
                  .tolist() for p in prompts]
    assert got == single == generate(model, prompts, 4, policy=Controller(max_budget=model.cfg.r_max)).tokens
