"""The tests' one model factory: a seeded `tiny` PrismeModel whose workspace is visible in the logits and whose
controller both edits and stops, so that equivalence checks and negative controls have something to see."""

from __future__ import annotations

import torch

from prisme.config import PrismeConfig
from prisme.model.prisme import PrismeModel
from prisme.options import DecodeOptions, ExecutionOptions


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float64, controller: bool = True,
               decode: DecodeOptions | None = None, execution: ExecutionOptions | None = None,
               **overrides) -> PrismeModel:
    """`tiny` (with `overrides`) in eval mode, weights drawn after `torch.manual_seed(seed)`, decoding with `decode`
    (`prisme.options.DecodeOptions`; None: the default, projected entries kept) and running its editor as `execution`
    says (`prisme.options.ExecutionOptions`; None: eager, no slot K/V cache); with a workspace, the
    readout's U ~ N(0, 0.5) (U starts at zero, which would hide every edit) and, if `controller`, every controller
    parameter ~ N(0, 0.3) (decisions that vary from position to position); with a router, its head ~ N(0, 0.5), the
    weight of its n-gram feature 1 and its bias -1.2 (it fires where the n-gram was seen before, and elsewhere at
    some positions only), and its token table (`router_token`) ~ N(0, 0.5)."""
    torch.manual_seed(seed)
    model = PrismeModel(PrismeConfig.from_name("tiny", **overrides), decode, None, execution).to(dtype).eval()
    if model.cfg.use_workspace:
        torch.nn.init.normal_(model.readout.U.weight, std=0.5)
        if controller:
            with torch.no_grad():
                for p in model.controller.parameters():
                    torch.nn.init.normal_(p, std=0.3)
        if model.cfg.router:
            with torch.no_grad():
                head = model.router.head
                torch.nn.init.normal_(head.weight, std=0.5)
                head.bias.fill_(-1.2)
                if model.cfg.router_ngram:
                    head.weight[:, -1] = 1.0
                if model.cfg.router_token:  # a value per token that moves decisions (zero at init otherwise)
                    torch.nn.init.normal_(model.router.token_value.weight, std=0.5)
    return model


POLICY_SETTINGS = ("budgets", "ks", "lambdas", "oracle_lambdas", "oracle_positions", "controller_budget", "kappa_risk")
POLICY_MODELS = ("matched", "references")


def evaluate(model, data, policies=None, **settings):
    """`evaluate_policies` on the named families (`standard_policies`) with keyword settings: those of
    `PolicySettings` (`POLICY_SETTINGS`) and the policies' models (`POLICY_MODELS`; `matched_backbone` for
    `matched`) go to the policies, the rest to `EvalOptions`."""
    from prisme.evaluation.families import PolicySettings, standard_policies
    from prisme.evaluation.run import EvalOptions, evaluate_policies

    if "matched_backbone" in settings:
        settings["matched"] = settings.pop("matched_backbone")
    chosen = {k: settings.pop(k) for k in list(settings) if k in POLICY_SETTINGS}
    models = {k: settings.pop(k) for k in list(settings) if k in POLICY_MODELS}
    policies = standard_policies(model, policies, PolicySettings(**chosen), **models)
    return evaluate_policies(model, data, policies, EvalOptions(**settings))
