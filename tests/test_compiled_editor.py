"""The compiled editor (`prisme.model.compiled_editor.compile_editor`): the same logits, traces and gradients as the
eager editor on forced actions (singles, pairs, DENSE, STOP, ragged budgets), the controller's rollout, ragged batched
decoding and a training step; the editor contracts hold on its padded graphs; a wrongly compiled graph is caught; and
where torch.compile cannot work, one warning and the eager path (or a ValueError when asked strictly).

Tolerance: float64, 1e-10 (the compiled graph sums in another order: differences are ~1e-15); `prisme bench
workspace --compile` checks float32 at 1e-4. The models have one editor block, and the inference tests share one
compiled editor (a module fixture), so the whole file compiles a handful of graphs: compilation is most of its time.
"""

from __future__ import annotations

import pytest
import torch
from conftest import assert_close
from test_generate import make_model as random_model

from prisme import faults
from prisme.config import PrismeConfig
from prisme.model.compiled_editor import CompiledEditor, compile_editor, uncompile_editor
from prisme.model.policy import Controller
from prisme.model.prisme import PrismeModel
from prisme.options import ExecutionOptions

TOL = {torch.float64: 1e-10}
NEGATIVE_MIN = 1e-3


def make_model(dtype: torch.dtype, seed: int = 0) -> PrismeModel:
    """test_generate's random tiny model (every edit visible, a controller that edits and stops), one editor block."""
    return random_model(dtype, seed, n_edit_blocks=1)


def forced_actions(cfg: PrismeConfig, B: int, T: int, R: int, seed: int = 3, singles_only: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random actions `[B, T, R]` over every group (singles, pairs, DENSE; or single slots only) with STOPs, and
    budgets `[B, T]`."""
    g = torch.Generator().manual_seed(seed)
    acts = torch.randint(0, cfg.n_slots if singles_only else cfg.dense_action + 1, (B, T, R), generator=g)
    budget = torch.randint(1, R + 1, (B, T), generator=g)
    acts = torch.where(torch.arange(R).view(1, 1, R) < budget.unsqueeze(-1), acts, cfg.stop_action)
    return acts, budget


@pytest.fixture(scope="module")
def pair64() -> tuple[PrismeModel, PrismeModel]:
    """(eager, compiled) float64 models with the same weights."""
    eager, comp = make_model(torch.float64), make_model(torch.float64)
    assert compile_editor(comp, strict=True, min_positions=0)
    return eager, comp


@pytest.mark.slow  # compiles the editor (about a minute for the file): `make test-slow`, CI
def test_compiled_editor_forced_actions_equal_eager_float64(pair64):
    eager, comp = pair64
    tokens = torch.randint(0, eager.cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    acts, budget = forced_actions(eager.cfg, 3, 12, 3)
    with torch.no_grad():
        ref = eager(tokens, acts, budget, return_state=True)
        out = comp(tokens, acts, budget, return_state=True)
    assert_close(out.logits, ref.logits, TOL[torch.float64], "compiled vs eager logits")
    assert_close(out.S_final, ref.S_final, TOL[torch.float64], "compiled vs eager workspace")
    assert comp.editor.run.compiled.calls["compiled"] > 0 and comp.editor.run.compiled.calls["eager"] == 0
    # the same graphs serve another batch, length and budget (dynamic sizes)
    tokens2 = torch.randint(0, eager.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(2))
    acts2, budget2 = forced_actions(eager.cfg, 2, 7, 2, seed=4)
    with torch.no_grad():
        assert_close(comp(tokens2, acts2, budget2).logits, eager(tokens2, acts2, budget2).logits,
                     TOL[torch.float64], "second shape")


@pytest.mark.slow  # compiles the editor (about a minute for the file): `make test-slow`, CI
def test_compiled_editor_contracts_idle_positions_and_untouched_slots_bitwise(pair64):
    """Positions that STOP keep the backbone's logits bitwise, and slots outside an action keep their values bitwise,
    on the compiled path too (its graphs run on the gathered, padded positions; nothing else is written)."""
    eager, comp = pair64
    cfg = comp.cfg
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    acts = torch.full((2, 10, 1), cfg.stop_action)
    # single-slot edits of slot 0 at (0, 3), (0, 5), (1, 2); pair edits of slots (0, 1) at (1, 7), (1, 8), (0, 9)
    acts[0, 3, 0] = acts[0, 5, 0] = acts[1, 2, 0] = 0
    acts[1, 7, 0] = acts[1, 8, 0] = acts[0, 9, 0] = cfg.n_slots
    with torch.no_grad():
        out = comp(tokens, acts, return_state=True)
        backbone = comp.backbone.head(comp.backbone(tokens))
    idle = acts[..., 0] == cfg.stop_action
    assert torch.equal(out.logits[idle], backbone[idle])
    assert not torch.equal(out.logits[0, 3], backbone[0, 3])
    S0 = out.ctx.S0
    for b, t in ((0, 3), (0, 5), (1, 2)):
        assert torch.equal(out.S_final[b, t, 1:], S0[b, t, 1:]) and not torch.equal(out.S_final[b, t, 0], S0[b, t, 0])
    for b, t in ((1, 7), (1, 8), (0, 9)):
        assert torch.equal(out.S_final[b, t, 2:], S0[b, t, 2:]) and not torch.equal(out.S_final[b, t, :2],
                                                                                      S0[b, t, :2])
    assert torch.equal(out.S_final[idle], S0[idle])


@pytest.mark.slow  # compiles the editor (about a minute for the file): `make test-slow`, CI
def test_compiled_editor_controller_rollout_equals_eager(pair64):
    eager, comp = pair64
    tokens = torch.randint(0, eager.cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = eager.forward_policy(tokens, 3, lambda_cost=0.0)
        out = comp.forward_policy(tokens, 3, lambda_cost=0.0)
    assert torch.equal(out.actions, ref.actions) and torch.equal(out.n_edits, ref.n_edits)
    assert (ref.actions != eager.cfg.stop_action).any() and (ref.actions == eager.cfg.stop_action).any()
    assert_close(out.logits, ref.logits, TOL[torch.float64], "controller logits")


@pytest.mark.slow  # compiles the editor (about a minute for the file): `make test-slow`, CI
def test_compiled_editor_ragged_batched_decoding_equals_eager(pair64):
    """Rows of different lengths, a 2-token chunk (the dynamic graphs) then one token per step (the fixed-shape decode
    graphs, the bank at its capacity, every row padded in), the controller deciding: the same traces and logits."""
    eager, comp = pair64
    lengths = [7, 4, 7]
    tokens = torch.randint(0, eager.cfg.vocab_size, (3, 7), generator=torch.Generator().manual_seed(7))
    chunks = [(0, 2)] + [(i, 1) for i in range(2, 7)]
    outs = {}
    for name, m in (("eager", eager), ("compiled", comp)):
        state = m.new_decode_state(3, max_len=12)
        logits, actions = [], []
        with torch.inference_mode():
            for i, c in chunks:
                n_new = [min(max(L - i, 0), c) for L in lengths]
                o = state.decode_step(tokens[:, i:i + c], n_new, policy=Controller(max_budget=3, lambda_cost=0.0))
                logits.append(o.logits)
                actions.append(o.actions)
        outs[name] = torch.cat(logits, 1), torch.cat(actions, 1)
    assert torch.equal(outs["compiled"][1], outs["eager"][1])
    assert (outs["eager"][1] != eager.cfg.stop_action).any()
    for b, L in enumerate(lengths):
        assert_close(outs["compiled"][0][b, :L], outs["eager"][0][b, :L], TOL[torch.float64], f"row {b}")
    assert any(k[0] == "static" for k in comp.editor.run.compiled.graphs)  # the fixed-shape decode graphs ran


def test_small_groups_run_the_eager_pass_below_min_positions():
    """With the default threshold, a group of fewer active positions than `MIN_POSITIONS` runs eagerly (bitwise the
    eager editor), and nothing is compiled."""
    model, ref = make_model(torch.float64), make_model(torch.float64)
    assert model.set_execution(ExecutionOptions(compile="auto", static_decode=False))
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    acts, budget = forced_actions(model.cfg, 2, 6, 2)
    with torch.no_grad():
        assert torch.equal(model(tokens, acts, budget).logits, ref(tokens, acts, budget).logits)
    calls = model.editor.run.compiled.calls
    assert calls["eager_small"] > 0 and calls["compiled"] == 0 and not model.editor.run.compiled.graphs


@pytest.mark.slow  # compiles the editor (about a minute for the file): `make test-slow`, CI
def test_compiled_editor_training_gradients_equal_eager():
    """A workspace-stage loss and its gradients through the compiled editor (autograd graphs) equal eager (single-slot
    actions: one graph to compile)."""
    eager, comp = make_model(torch.float64, seed=1).train(), make_model(torch.float64, seed=1).train()
    assert compile_editor(comp, strict=True, min_positions=0)
    tokens = torch.randint(0, eager.cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(8))
    acts, budget = forced_actions(eager.cfg, 2, 8, 2, seed=9, singles_only=True)
    grads = {}
    for name, m in (("eager", eager), ("compiled", comp)):
        m.zero_grad()
        logits = m(tokens[:, :-1], acts[:, :-1], budget[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        grads[name] = (loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters()
                                       if p.grad is not None and n.startswith("editor.")})
    assert_close(grads["compiled"][0], grads["eager"][0], TOL[torch.float64], "loss")
    assert grads["eager"][1].keys() == grads["compiled"][1].keys() and grads["eager"][1]
    for n, g in grads["eager"][1].items():
        assert_close(grads["compiled"][1][n], g, TOL[torch.float64], n)
    assert comp.editor.run.compiled.calls["compiled"] > 0


@pytest.mark.slow  # compiles the editor (about a minute for the file): `make test-slow`, CI
def test_negative_control_a_compiled_graph_that_ignores_the_bank_mask_is_caught(pair64):
    """The equivalence check of the first test, on an editor compiled under `faults.compiled_editor_unmasked`
    (every position reads the whole bank, the future included): the logits move far past the tolerance (single-slot
    actions: one graph to compile)."""
    eager, _ = pair64
    broken = make_model(torch.float64)
    tokens = torch.randint(0, eager.cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1))
    acts, budget = forced_actions(eager.cfg, 3, 12, 3, singles_only=True)
    with faults.compiled_editor_unmasked():
        assert compile_editor(broken, strict=True, min_positions=0)
        with torch.no_grad():
            bad = broken(tokens, acts, budget).logits
    with torch.no_grad():
        ref = eager(tokens, acts, budget).logits
    assert (bad - ref).abs().max().item() > NEGATIVE_MIN
    uncompile_editor(broken)  # the eager editor of the same model is right
    with torch.no_grad():
        assert_close(broken(tokens, acts, budget).logits, ref, 0.0, "uncompiled")


def test_no_compiler_gives_one_warning_and_the_eager_editor_or_a_value_error_when_strict(monkeypatch):
    import prisme.model.compiled_editor as pc

    monkeypatch.setattr(pc, "_COMPILER_PROBE", "InvalidCxxCompiler: no working C++ compiler found")
    model = make_model(torch.float32)
    with pytest.warns(UserWarning, match="torch.compile does not work here"):
        assert compile_editor(model) is False
    assert model.editor.run.compiled is None
    with pytest.raises(ValueError, match="torch.compile does not work here.*InvalidCxxCompiler"):
        compile_editor(model, strict=True)


def test_a_graph_that_fails_to_compile_reruns_eagerly_never_half_compiled(monkeypatch):
    """The first compiled call raises (as a compiler crash would): that call's result comes from the eager pass,
    with one warning, and every later call runs eagerly; strict mode raises ValueError instead."""
    import prisme.model.compiled_editor as pc

    monkeypatch.setattr(pc, "_COMPILER_PROBE", "")  # torch.compile works here (the graph's own compile fails)
    model, ref_model = make_model(torch.float32), make_model(torch.float32)
    assert model.set_execution(ExecutionOptions(compile="auto", min_positions=0))

    def crash(*args, **kwargs):
        raise RuntimeError("backend compiler failed")

    monkeypatch.setattr(CompiledEditor, "_get", lambda self, key: crash)
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3))
    acts, budget = forced_actions(model.cfg, 2, 6, 2)
    with torch.no_grad(), pytest.warns(UserWarning, match="compiling the editor failed.*backend compiler failed"):
        out = model(tokens, acts, budget).logits
    with torch.no_grad():
        assert torch.equal(out, ref_model(tokens, acts, budget).logits)
    assert model.editor.run.compiled.calls["compiled"] == 0 and model.editor.run.compiled.calls["eager"] > 0
    assert model.set_execution(ExecutionOptions(compile="strict", min_positions=0))
    with torch.no_grad(), pytest.raises(ValueError, match="could not be compiled"):
        model(tokens, acts, budget)


def test_compile_editor_rejects_a_model_without_a_workspace():
    model = PrismeModel(PrismeConfig.from_name("tiny", use_workspace=False))
    with pytest.raises(ValueError, match="workspace"):
        compile_editor(model)


@pytest.mark.gpu
def test_compiled_editor_forced_actions_equal_eager_on_cuda():
    eager = make_model(torch.float32).cuda()
    comp = make_model(torch.float32).cuda()
    assert compile_editor(comp, strict=True, min_positions=0)
    tokens = torch.randint(0, eager.cfg.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1)).cuda()
    acts, budget = forced_actions(eager.cfg, 3, 12, 3)
    with torch.no_grad():
        assert_close(comp(tokens, acts.cuda(), budget.cuda()).logits, eager(tokens, acts.cuda(), budget.cuda()).logits,
                     1e-4, "cuda compiled vs eager")


def test_bad_compile_settings_are_value_errors_naming_the_field():
    from prisme.studies.recall_setup import RecallStudyConfig
    from prisme.studies.text import TextStudyConfig
    from prisme.training.config import StageConfig

    for make in (lambda: StageConfig(stage="workspace", compile="yes").validate(),
                 lambda: RecallStudyConfig(compile="on").validate(),
                 lambda: TextStudyConfig(compile=True).validate()):
        with pytest.raises(ValueError, match="compile"):
            make()
    with pytest.raises(ValueError, match="min_positions"):
        compile_editor(make_model(torch.float32), min_positions=-1)


def test_cli_compile_flag_choices(capsys):
    from prisme.cli import build_parser

    p = build_parser()
    assert p.parse_args(["generate", "--prompt", "a", "--compile"]).compile == "auto"
    assert p.parse_args(["generate", "--prompt", "a", "--compile", "strict"]).compile == "strict"
    assert p.parse_args(["generate", "--prompt", "a"]).compile is None
    with pytest.raises(SystemExit):
        p.parse_args(["eval", "--checkpoint", "x", "--compile", "fast"])
    assert "invalid choice" in capsys.readouterr().err


def test_compiling_and_the_slot_kv_cache_are_the_models_execution_options(monkeypatch):
    """`compile_editor` and `uncompile_editor` set the model's `ExecutionOptions` (`PrismeModel.set_execution`, which
    builds the editor's compiled pass; nothing compiles before a call), as `PrismeModel(cfg, execution=...)` does; the
    decode plan reads them there: a compiled editor runs the deployed budget-1 step on its fixed-shape fired-rows
    graphs (with `static_decode`; without, the routed plan) and any other budget on the static plan; an eager editor
    with the slot K/V cache takes the routed plan instead of the deployed step. Bad options are ValueErrors naming
    the field."""
    import prisme.model.compiled_editor as pc
    from prisme.model.plans import choose
    from prisme.model.policy import StepPolicy

    def decode_plan(m, ws, Q):  # the plan a fresh decode state of the model's own options takes
        return choose(m.new_decode_state(1), ws, Q).name

    monkeypatch.setattr(pc, "_COMPILER_PROBE", "")
    model = make_model(torch.float32)
    assert model.execution == ExecutionOptions() and model.editor.run.compiled is None
    assert compile_editor(model, strict=True, min_positions=3)
    assert model.execution == ExecutionOptions(compile="strict", min_positions=3)
    assert isinstance(model.editor.run.compiled, CompiledEditor) and model.editor.run.compiled.min_positions == 3
    uncompile_editor(model)
    assert model.execution.compile == "off" and model.editor.run.compiled is None
    built = PrismeModel(PrismeConfig.from_name("tiny", router=True), execution=ExecutionOptions(compile="auto"))
    one = StepPolicy(max_budget=1)  # a controller policy of budget 1, one query per row
    assert isinstance(built.editor.run.compiled, CompiledEditor) and decode_plan(built, one, 1) == "budget1"
    assert decode_plan(built, StepPolicy(max_budget=2), 1) == "static" and decode_plan(built, one, 2) == "general"
    built.set_execution(ExecutionOptions(compile="auto", static_decode=False))
    assert decode_plan(built, one, 1) == "routed"
    built.set_execution(ExecutionOptions())
    assert decode_plan(built, one, 1) == "budget1"
    built.set_execution(ExecutionOptions(slot_kv_cache=True))
    assert built.editor.run.slot_kv and decode_plan(built, one, 1) == "routed"
    for bad in (dict(compile="yes"), dict(slot_kv_cache=1), dict(min_positions=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            ExecutionOptions(**bad)
    with pytest.raises(ValueError, match="workspace"):
        PrismeModel(PrismeConfig.from_name("tiny", use_workspace=False), execution=ExecutionOptions(compile="auto"))
