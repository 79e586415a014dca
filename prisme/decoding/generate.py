"""Batched generation with the workspace (SPEC §4): prompts of any lengths decoded together through one
`DecodeState`, each row with its own generator, stop tokens and budget; a stream of events per token (the actions
taken, their ops); the price calibration that finds the lambda giving a target cost; and `prisme generate`."""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from prisme.checks import check_max_budget, check_utf8, is_int
from prisme.costs.traces import TokenPricer, run_cost
from prisme.decoding.sampling import GREEDY, Sampling, sample_logits
from prisme.model.backbone import check_tokens
from prisme.model.policy import BACKBONE, Controller
from prisme.model.prisme import PrismeModel
from prisme.options import DecodeOptions, ExecutionOptions, Runtime


# ====================================================================== generation
@dataclass
class Calibration:
    """The lambda found for a target cost and what it achieved on the calibration pass (prompts, teacher-forced)."""

    target_cost: float
    lambda_cost: float
    relative_cost: float  # achieved mean relative cost on the prompts
    evaluations: int  # forward_policy passes used


@dataclass
class GenerationEvent:
    """One generation step: the token each row produced (None for rows already finished)."""

    step: int  # index of the new token within each row (0 = first generated token)
    tokens: list[int | None]  # [B]
    positions: list[int | None]  # [B] the position whose logits produced the token (its context is position + 1)
    actions: torch.Tensor  # [B, R] that position's action trace (STOP rows for finished rows)
    n_edits: list[int | None]  # [B]
    controller_steps: list[int | None]  # [B]
    ops: list[int | None]  # [B] analytic ops of that position (costs.trace_cost, own context)
    finished: list[bool]  # [B] the row is done after this step (stop token or max_new_tokens)


@dataclass
class GenerationOutput:
    """Generated tokens per row with each token's action trace and analytic cost."""

    tokens: list[list[int]]  # new tokens per row (a stop token that ended the row is included)
    prompt_lengths: list[int]
    actions: list[torch.Tensor]  # per row [n_b, R]
    n_edits: list[list[int]]
    controller_steps: list[list[int]]
    ops: list[list[int]]  # per token, with each position's own context
    relative_cost: float  # total ops / backbone-only ops over every generated token (1.0 = the backbone alone)
    lambda_cost: float  # the controller's price of compute that was used
    finish_reasons: list[str]  # "stop" or "length"
    calibration: Calibration | None = None


@dataclass
class _Run:
    """A fully checked generation request."""

    model: PrismeModel
    tokens: torch.Tensor  # [B, P] right-padded prompts
    lengths: list[int]
    max_new_tokens: int
    sampling: Sampling
    stop_tokens: frozenset[int]
    policy: Controller  # with its lambda_cost resolved (the model's default, or the calibrated one)
    calibration: Calibration | None
    runtime: Runtime  # its decode options, execution and prefill chunk size

    @property
    def options(self) -> DecodeOptions:
        return self.model.decode_options if self.runtime.decode is None else self.runtime.decode

    @property
    def execution(self) -> ExecutionOptions:
        return self.model.execution if self.runtime.execution is None else self.runtime.execution

    @property
    def max_budget(self) -> int:
        return self.policy.max_budget

    @property
    def lambda_cost(self) -> float:
        return self.policy.lambda_cost


def generate(model: PrismeModel, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int,
             policy: Controller | None = None, sampling: Sampling | None = None, stop_tokens: Sequence[int] = (),
             stream: bool = False, runtime: Runtime | None = None) -> GenerationOutput | Iterator[GenerationEvent]:
    """Generate up to `max_new_tokens` per prompt with the workspace under the controller.

    Args:
        prompts: token ids per row (lists of different lengths are batched right-padded), or a `[B, P]` / `[P]`
            tensor.
        policy: the workspace's policy (`prisme.model.policy.Controller`; None: the backbone alone): its budget and
            prices, or a `target_cost`, a mean relative cost per token (ops / backbone-only ops, >= 1) for which
            lambda_cost is found by bisection on a teacher-forced calibration pass over the prompts
            (`calibrate_lambda`).
        sampling: how each token is picked (`prisme.decoding.sampling.Sampling`; None: greedy).
        stop_tokens: a row ends after producing one of these (it is kept in the output).
        stream: return an iterator of per-step `GenerationEvent`s instead of the finished `GenerationOutput`.
        runtime: how it runs (`prisme.options.Runtime`: the decode state's bank options and execution options, so one
            model generates either way; the prompt's prefill chunk size; None: the model's own, one chunk).

    All arguments are checked (and lambda calibrated) before anything runs; bad input is a ValueError.
    """
    run = _prepare(model, prompts, max_new_tokens, BACKBONE if policy is None else policy,
                   GREEDY if sampling is None else sampling, stop_tokens, Runtime() if runtime is None else runtime)
    return _events(run) if stream else _collect(run)


def generate_stream(model: PrismeModel, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int,
                    **kwargs) -> Iterator[GenerationEvent]:
    """`generate(..., stream=True)`: checks everything now, then yields one `GenerationEvent` per step."""
    return generate(model, prompts, max_new_tokens, stream=True, **kwargs)


def calibrate_lambda(model: PrismeModel, prompts: Sequence[Sequence[int]] | torch.Tensor, max_budget: int,
                     target_cost: float, kappa_risk: float | None = None, rel_tol: float = 1e-3,
                     max_evals: int = 40) -> Calibration:
    """Find lambda_cost whose controller spends `target_cost` (mean ops / backbone-only ops) on the prompts.

    One teacher-forced `forward_policy` pass per probe; the cost of its traces is `costs.trace_cost` with each
    position's own context. Cost falls (stepwise) as lambda grows: lambda is bracketed on a log grid, then bisected
    until the cost is within `rel_tol` of the target or the bracket collapses; the closest probe wins.
    """
    tokens, lengths = _pad_prompts(prompts, model.cfg.vocab_size)
    tokens = tokens.to(model.backbone.tok_emb.weight.device)
    return _calibrate(model, tokens, lengths, max_budget, target_cost, kappa_risk, rel_tol, max_evals)


@torch.no_grad()
def _calibrate(model: PrismeModel, tokens: torch.Tensor, lengths: list[int], max_budget: int, target_cost: float,
               kappa_risk: float | None, rel_tol: float = 1e-3, max_evals: int = 40) -> Calibration:
    cfg = model.cfg
    if max_budget < 1 or not cfg.use_workspace:
        raise ValueError("target_cost needs a workspace model and max_budget >= 1")
    if isinstance(target_cost, bool) or not isinstance(target_cost, (int, float)) or not math.isfinite(target_cost):
        raise ValueError(f"target_cost must be a finite number, got {target_cost!r}")
    B, P = tokens.shape
    valid = torch.arange(P, device=tokens.device) < torch.tensor(lengths, device=tokens.device)[:, None]  # [B, P]
    contexts = (torch.arange(P, device=tokens.device) + 1).expand(B, P)[valid]  # [N]
    N = contexts.numel()
    stop_all = torch.full((N, max_budget), cfg.stop_action, dtype=torch.long)
    steps0 = torch.full((N,), 0 if cfg.router else 1, dtype=torch.long)  # the router decides step 0 alone
    floor = run_cost(model, stop_all, contexts, steps0, cfg.router).relative  # as generation's decode state runs
    if target_cost < floor * (1 - rel_tol):
        raise ValueError(f"target_cost={target_cost} is below the cheapest controller policy's cost {floor:.6f} "
                         f"(every position stopping at once); use max_budget=0 for the backbone alone")
    probes: list[tuple[float, float]] = []

    def cost_at(lam: float) -> float:
        out = model.forward_policy(tokens, policy=Controller(max_budget, lam, kappa_risk))
        rel = run_cost(model, out.actions[valid], contexts, out.controller_steps[valid], cfg.router).relative
        probes.append((lam, rel))
        return rel

    def close(c: float) -> bool:
        return abs(c - target_cost) <= rel_tol * target_cost

    lo, hi = 0.0, None
    top = cost_at(0.0)  # the costliest policy: every edit the controller wants at lambda 0
    if top < target_cost and not close(top):
        more = f", or a larger budget (max_budget, --budget; up to r_max={cfg.r_max})" if max_budget < cfg.r_max else ""
        raise ValueError(f"target_cost={target_cost} is above the costliest controller policy's cost {top:.6f} on "
                         f"these prompts (lambda 0: every edit the controller wants at max_budget={max_budget}); pass "
                         f"a target of at most {top:.4f}{more}")
    if top > target_cost and not close(top):
        for lam in (10.0 ** k for k in range(-6, 13)):  # bracket: cost(lo) > target >= cost(hi)
            c = cost_at(lam)
            if c <= target_cost or close(c):
                hi = lam
                break
            lo = lam
        while hi is not None and len(probes) < max_evals and not close(probes[-1][1]) and hi - lo > 1e-6 * hi:
            mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
            if cost_at(mid) > target_cost:
                lo = mid
            else:
                hi = mid
    lam, rel = min(probes, key=lambda p: (abs(p[1] - target_cost), p[0]))
    return Calibration(target_cost=float(target_cost), lambda_cost=lam, relative_cost=rel, evaluations=len(probes))


def _pad_prompts(prompts: Sequence[Sequence[int]] | torch.Tensor, vocab_size: int) -> tuple[torch.Tensor, list[int]]:
    """Right-padded `[B, P]` ids (padding 0) and each row's length; ValueError for empty or out-of-range prompts.
    NumPy arrays and NumPy integers are accepted where tensors and ints are."""
    if isinstance(prompts, np.ndarray):
        if prompts.dtype.kind not in "iu":
            raise ValueError(f"a prompt array must hold integer token ids, got dtype {prompts.dtype}")
        prompts = torch.from_numpy(prompts.astype(np.int64))
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() == 1:
            prompts = prompts.unsqueeze(0)
        if prompts.dim() != 2:
            raise ValueError(f"a prompt tensor must have shape [B, P] or [P], got {tuple(prompts.shape)}")
        check_tokens(prompts, vocab_size, "prompt")
        return prompts.long(), [prompts.shape[1]] * prompts.shape[0]
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists (or a [B, P] tensor)")
    rows = []
    for b, row in enumerate(prompts):
        row = row.tolist() if isinstance(row, (torch.Tensor, np.ndarray)) else row
        if isinstance(row, Sequence) and not isinstance(row, (str, bytes)):
            row = [int(t) if isinstance(t, np.integer) else t for t in row]
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence) or len(row) == 0:
            raise ValueError(f"prompt {b} is empty or not a list of token ids; encode text with a tokenizer first")
        if any(not is_int(t) for t in row):
            raise ValueError(f"prompt {b} must hold int token ids")
        lo, hi = min(row), max(row)
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"prompt {b}: ids must lie in [0, {vocab_size}), got min {lo} and max {hi}")
        rows.append(list(row))
    P = max(map(len, rows))
    tokens = torch.tensor([r + [0] * (P - len(r)) for r in rows], dtype=torch.long)  # [B, P]
    return tokens, [len(r) for r in rows]


def _prepare(model: PrismeModel, prompts: Sequence[Sequence[int]] | torch.Tensor, max_new_tokens: int,
             policy: Controller, sampling: Sampling, stop_tokens: Sequence[int], runtime: Runtime) -> _Run:
    cfg = model.cfg
    tokens, lengths = _pad_prompts(prompts, cfg.vocab_size)
    tokens = tokens.to(model.backbone.tok_emb.weight.device)
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if max(lengths) + max_new_tokens > cfg.max_seq_len:
        raise ValueError(f"the longest prompt ({max(lengths)} tokens) + max_new_tokens={max_new_tokens} exceeds "
                         f"T_max={cfg.max_seq_len}, the cache capacity")
    if not isinstance(sampling, Sampling):
        raise ValueError(f"sampling must be a prisme.decoding.sampling.Sampling (or None: greedy), got "
                         f"{type(sampling).__name__}")
    if isinstance(stop_tokens, (str, bytes)) or not hasattr(stop_tokens, "__iter__"):
        raise ValueError(f"stop_tokens must be a sequence of token ids, got {stop_tokens!r}")
    stops = list(stop_tokens)
    if any(not is_int(t) or not 0 <= t < cfg.vocab_size for t in stops):
        raise ValueError(f"stop_tokens must be ids in [0, {cfg.vocab_size}), got {stops}")
    if not isinstance(policy, Controller):
        raise ValueError(f"policy must be a prisme.model.policy.Controller (or None: the backbone alone), got "
                         f"{type(policy).__name__}")
    check_max_budget(policy.max_budget, cfg.r_max, cfg.use_workspace)
    if not isinstance(runtime, Runtime):
        raise ValueError(f"runtime must be a prisme.options.Runtime (or None), got {type(runtime).__name__}")
    if runtime.decode is not None:
        runtime.decode.check(cfg)
    calibration, lam = None, policy.lambda_cost
    if policy.target_cost is not None:
        calibration = _calibrate(model, tokens, lengths, policy.max_budget, policy.target_cost, policy.kappa_risk)
        lam = calibration.lambda_cost
    resolved = dataclasses.replace(policy, lambda_cost=float(model.default_price.fill(lam, None)[0]),
                                   target_cost=None)
    return _Run(model, tokens, lengths, max_new_tokens, sampling, frozenset(stops), resolved, calibration, runtime)


def _row_seed(seed: int, row: int) -> int:
    """A 63-bit seed for one row's sampler, distinct for every (seed, row) pair in practice."""
    return (seed * 0x9E3779B97F4A7C15 + row * 0xBF58476D1CE4E5B9 + 1) % 2**63


@torch.inference_mode()
def _events(run: _Run) -> Iterator[GenerationEvent]:
    model, cfg = run.model, run.model.cfg
    B = len(run.lengths)
    dev = run.tokens.device
    gens = None
    smp = run.sampling
    if smp.temperature > 0:  # one generator per row: a row's samples do not depend on the others or on their stops
        base = random.SystemRandom().randrange(2**62) if smp.seed is None else smp.seed
        gens = [torch.Generator(device=dev).manual_seed(_row_seed(base, b)) for b in range(B)]
    state = model.new_decode_state(B, max_len=max(run.lengths) + run.max_new_tokens - 1, bank=run.max_budget > 0,
                                   options=run.runtime.decode, execution=run.runtime.execution)
    policy = run.policy if run.max_budget > 0 else None
    out = state.prefill(run.tokens, run.lengths, run.runtime.prefill_chunk_size, logits="last", policy=policy)
    ops_of = TokenPricer(model, run.max_budget, state.options, state.execution)
    done = [False] * B
    done_t = torch.zeros(B, dtype=torch.bool, device=dev)  # `done` on the device, uploaded only when it changes
    picked = done_t.long()  # replaced at step 0
    for step in range(run.max_new_tokens):
        if step > 0:  # the tokens just picked, still on the device (a finished row's is not read: it appends none)
            out = state.decode_step(picked.view(B, 1), [0 if d else 1 for d in done], policy)
        active = [b for b in range(B) if not done[b]]
        if gens is None:
            picked = out.logits[:, -1].argmax(-1)  # [B]
        else:
            picked = torch.cat([sample_logits(out.logits[b:b + 1, -1], smp.temperature, smp.top_k, smp.top_p, gens[b])
                                if not done[b] else out.positions.new_zeros(1) for b in range(B)])
        acts = out.actions[:, -1]  # [B, R]
        # everything the host needs of this step in one device-to-host copy (one sync per token, not five)
        host = torch.cat([picked[:, None], out.positions[:, -1:], out.n_edits[:, -1:], out.controller_steps[:, -1:],
                          acts], dim=1).tolist()  # [B, 4 + R]
        new = [host[b][0] for b in active]
        pos_l, n_l, s_l = [r[1] for r in host], [r[2] for r in host], [r[3] for r in host]
        acts_l = [r[4:] for r in host]
        ev = GenerationEvent(step=step, tokens=[None] * B, positions=[None] * B,
                             actions=acts.masked_fill(done_t[:, None], cfg.stop_action),
                             n_edits=[None] * B, controller_steps=[None] * B, ops=[None] * B, finished=[True] * B)
        before = list(done)
        for b, tok in zip(active, new):
            done[b] = tok in run.stop_tokens or step == run.max_new_tokens - 1
            ev.tokens[b], ev.positions[b], ev.n_edits[b], ev.controller_steps[b] = tok, pos_l[b], n_l[b], s_l[b]
            ev.ops[b] = ops_of(pos_l[b] + 1, acts_l[b], s_l[b])
            ev.finished[b] = done[b]
        yield ev
        if all(done):
            return
        if done != before:
            done_t = torch.tensor(done, device=dev)


def _collect(run: _Run) -> GenerationOutput:
    cfg = run.model.cfg
    B = len(run.lengths)
    toks: list[list[int]] = [[] for _ in range(B)]
    acts: list[list[torch.Tensor]] = [[] for _ in range(B)]
    n_edits: list[list[int]] = [[] for _ in range(B)]
    steps: list[list[int]] = [[] for _ in range(B)]
    ops: list[list[int]] = [[] for _ in range(B)]
    contexts: list[list[int]] = [[] for _ in range(B)]
    reasons = ["length"] * B
    for ev in _events(run):
        for b in range(B):
            if ev.tokens[b] is None:
                continue
            toks[b].append(ev.tokens[b])
            acts[b].append(ev.actions[b])
            n_edits[b].append(ev.n_edits[b])
            steps[b].append(ev.controller_steps[b])
            ops[b].append(ev.ops[b])
            contexts[b].append(ev.positions[b] + 1)
            if ev.tokens[b] in run.stop_tokens:
                reasons[b] = "stop"
    actions = [torch.stack(a) for a in acts]  # [n_b, R] each
    flat = None if run.max_budget == 0 else torch.cat(actions)
    cost = run_cost(run.model, flat, [c for row in contexts for c in row], [s for row in steps for s in row],
                    cfg.router, run.options, run.execution)  # as its decode state ran
    return GenerationOutput(tokens=toks, prompt_lengths=list(run.lengths), actions=actions, n_edits=n_edits,
                            controller_steps=steps, ops=ops, relative_cost=cost.relative, lambda_cost=run.lambda_cost,
                            finish_reasons=reasons, calibration=run.calibration)


# ====================================================================== command line
def main(args: argparse.Namespace) -> int:
    """`prisme generate`: load a model (checkpoint, or a preset with random weights), generate, print the text."""
    from prisme.checkpoint import find_model_checkpoint, load_model, load_tokenizer
    from prisme.config import PrismeConfig
    from prisme.data.tokenizers import ByteTokenizer, tokenizer_named

    if args.threads != -1:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1 (or -1 to leave torch's setting), got {args.threads}")
        torch.set_num_threads(args.threads)
    device = getattr(args, "device", None) or "auto"
    if device == "auto":  # the working commands' default (eval, train): the GPU where there is one
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device!r} requested but CUDA is not available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"--device must be cpu or cuda[:N], got {device!r}")
    tokenizer = None if args.tokenizer is None else tokenizer_named(args.tokenizer)
    if args.checkpoint is not None:
        path = find_model_checkpoint(args.checkpoint)
        if str(path) != str(args.checkpoint):
            print(f"note: using {path}", file=sys.stderr)
        model, _meta = load_model(path, map_location=device)
        if tokenizer is None:  # the checkpoint's own; None for a token-id model (MQAR)
            tokenizer = load_tokenizer(path)
            if tokenizer is None and getattr(args, "prompt_ids", None) is None:
                raise ValueError(f"{path} was trained on token ids (no text tokenizer): pass --prompt-ids")
        from prisme.checkpoint import trained_groups
        from prisme.config import untrained_for_policy

        missing = untrained_for_policy(model.cfg, trained_groups(_meta), args.budget)
        if missing:
            msg = (f"--budget {args.budget} runs the model's {' and '.join(missing)}, which no stage of {path} trained "
                   f"(a {_meta.stage!r} checkpoint): train it first, or pass --budget 0 for the backbone alone")
            if not getattr(args, "allow_untrained", False):
                raise ValueError(msg + " (or --allow-untrained to run it anyway)")
            print(f"warning: {msg}", file=sys.stderr)
    else:
        torch.manual_seed(0 if args.seed is None else args.seed)
        model = PrismeModel(PrismeConfig.from_name(args.preset))
        tokenizer = tokenizer or ByteTokenizer()
        print(f"note: preset {args.preset!r} with random weights (pass --checkpoint for a trained model)",
              file=sys.stderr)
    model = model.to(device).eval()
    from prisme.model.compiled_editor import maybe_compile

    maybe_compile(model, getattr(args, "compile", None))
    ids_mode = getattr(args, "prompt_ids", None) is not None
    if not ids_mode and tokenizer.vocab_size > model.cfg.vocab_size:
        what = "the byte tokenizer" if isinstance(tokenizer, ByteTokenizer) else f"tokenizer {tokenizer!r}"
        raise ValueError(f"{what} has {tokenizer.vocab_size} ids but the model's vocab_size is {model.cfg.vocab_size}: "
                         f"use a model with vocab_size >= {tokenizer.vocab_size} (e.g. --preset demo), another "
                         f"--tokenizer, or --prompt-ids")
    if ids_mode:
        try:
            prompt = [int(v) for v in args.prompt_ids.split(",") if v.strip()]
        except ValueError:
            raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        if not prompt:
            raise ValueError("--prompt-ids lists no token id")
        bad = [i for i in prompt if not 0 <= i < model.cfg.vocab_size]
        if bad:
            raise ValueError(f"--prompt-ids: id {bad[0]} lies outside the model's vocabulary "
                             f"[0, {model.cfg.vocab_size})")
        decode = lambda ids: " " + " ".join(str(i) for i in ids)  # noqa: E731
        args.prompt = ",".join(str(i) for i in prompt)
    else:
        prompt = tokenizer.encode(check_utf8(args.prompt, "--prompt"))
        decode = tokenizer.decode
    out = generate(model, [prompt], args.max_new_tokens,
                   Controller(args.budget, args.lambda_cost, args.kappa_risk, target_cost=args.target_cost),
                   Sampling(args.temperature, args.top_k, args.top_p, args.seed))
    print(args.prompt + decode(out.tokens[0]))
    cal = "" if out.calibration is None else (f", calibrated on the prompt to {out.calibration.relative_cost:.4f} "
                                              f"(target {out.calibration.target_cost})")
    print(f"[{len(out.tokens[0])} tokens, budget {args.budget}, lambda {out.lambda_cost:.6g}{cal}; "
          f"mean relative cost {out.relative_cost:.4f} x the backbone]", file=sys.stderr)
    if args.show_edits:
        from prisme.model.workspace import slots_of_action

        stop, cfg = model.cfg.stop_action, model.cfg
        legend = ", ".join(f"{a}={'+'.join(map(str, slots_of_action(cfg, a)))}" for a in range(cfg.n_actions))
        print(f"legend: edits = actions applied at that position; steps = controller evaluations (the edits plus "
              f"the STOP that ended them, at most the budget); actions = the action ids, each editing the slots "
              f"{legend} (STOP={stop})")
        print(f"{'pos':>5}  {'token':<8}{'edits':>6}{'steps':>6}  actions")
        for i, tok in enumerate(out.tokens[0]):
            acts = [a for a in out.actions[0][i].tolist() if a != stop]
            print(f"{len(prompt) + i:>5}  {decode([tok]).strip() if ids_mode else repr(decode([tok])):<8}"
                  f"{out.n_edits[0][i]:>6}"
                  f"{out.controller_steps[0][i]:>6}  {'#' * out.n_edits[0][i]:<{max(args.budget, 1)}} {acts}")
    return 0
