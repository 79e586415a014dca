"""The whole model in transformers: `prisme export-hf --workspace` writes a folder that
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` loads, whose logits are PRISME's for the
backbone path, the exported policy and forced actions (float32, 1e-5; they are PRISME's own modules), whose
`generate` gives `prisme.generate`'s greedy tokens, with its tokenizer and a model card."""

from __future__ import annotations

import pytest
import torch
from test_run_safety import run_cli

from prisme.checkpoint import save_checkpoint
from prisme.config import PrismeConfig
from prisme.data.tokenizers import ByteTokenizer
from prisme.decoding.generate import generate
from prisme.model.prisme import PrismeModel

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_full")
    torch.manual_seed(0)
    model = PrismeModel(PrismeConfig.from_name("tiny").replace(vocab_size=256, router=True)).eval()
    torch.nn.init.normal_(model.readout.U.weight, std=0.5)  # edits that move the logits
    save_checkpoint(root / "ck", model, stage="router", step=3, tokenizer=ByteTokenizer(),
                    stage_config={"max_budget": 2, "dataset": "austen"},
                    extra={"trained_groups": ["backbone", "workspace", "controller", "router"]})
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
    want = generate(model, prompt, 4, max_budget=2).tokens
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
    save_checkpoint(tmp_path / "ck", model, stage="workspace", step=1, tokenizer=ByteTokenizer(),
                    stage_config={"max_budget": 2}, extra={"trained_groups": ["backbone", "workspace"]})
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
