"""Text in, text out: a checkpoint with its tokenizer (`load`), and generation from strings (`generate_text`).

    import prisme
    lm = prisme.load("runs/mine")                       # a checkpoint, a run folder, or a `prisme fit` folder
    out = lm.generate("def parse(", max_new_tokens=64)   # the deployable policy (budget 1) where its stages trained one
    print(out.text, out.edits_per_token)

What runs is `generate` (`prisme.decoding.generate`): KV cache, incremental bank, the policy's edits; `TextOutput`
keeps its `GenerationOutput` beside the decoded strings.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from prisme.decoding.generate import GenerationOutput, generate
from prisme.decoding.sampling import Sampling
from prisme.model.policy import Controller


@dataclass(frozen=True)
class TextOutput:
    """One prompt's generation as text.

    text: the prompt and its continuation; new_text: the continuation alone; tokens: its token ids; edits: the
    workspace's edits at each new token (0: the backbone's logits, bit for bit); edits_per_token: their mean;
    relative_cost: the generation's ops over the backbone alone's (1.0: no edit); output: the `GenerationOutput`
    (actions, controller steps, ops per token, the price used, why it stopped)."""

    text: str
    new_text: str
    tokens: list[int]
    edits: list[int]
    edits_per_token: float
    relative_cost: float
    output: GenerationOutput


@dataclass
class LanguageModel:
    """A trained PRISME model with its tokenizer (`load`): `generate` takes and returns strings."""

    model: Any  # `PrismeModel`, in eval mode
    tokenizer: Any  # `prisme.data.tokenizers.Tokenizer`
    path: Path | None = None  # the checkpoint it was loaded from
    deployable_budget: int = 0  # the largest budget its trained stages run (1: a router or controller; 0: none)

    def generate(self, prompt: str | list[str], max_new_tokens: int = 64, policy: Controller | None = None,
                 sampling: Sampling | None = None) -> TextOutput | list[TextOutput]:
        """`generate_text(self, ...)`."""
        return generate_text(self, prompt, max_new_tokens, policy, sampling)


def load(path: str | Path, device: str | torch.device = "cpu") -> LanguageModel:
    """A checkpoint with its tokenizer: `path` is a checkpoint, a run folder (its latest), a `prisme fit` folder (its
    deployable stage) or a study folder (its most trained stage). ValueError for a model trained on token ids (no
    tokenizer: use `prisme.generate` with ids)."""
    from prisme.checkpoint import find_model_checkpoint, load_model, load_tokenizer, trained_groups
    from prisme.config import untrained_for_policy

    found = find_model_checkpoint(path)
    model, meta = load_model(found, map_location=device)
    tok = load_tokenizer(found)
    if tok is None:
        raise ValueError(f"{found} was trained on token ids, not text (no tokenizer): generate from ids with "
                         f"prisme.generate(model, [[...]], n)")
    budget = 1 if model.cfg.use_workspace and not untrained_for_policy(model.cfg, trained_groups(meta), 1) else 0
    return LanguageModel(model.eval(), tok, found, budget)


def generate_text(lm: LanguageModel, prompt: str | list[str], max_new_tokens: int = 64,
                  policy: Controller | None = None, sampling: Sampling | None = None
                  ) -> TextOutput | list[TextOutput]:
    """Continue `prompt` (a string, or a list of them: one batch) by `max_new_tokens` tokens. `policy`: what the
    workspace runs (default: `Controller(max_budget=lm.deployable_budget)`, the trained router or controller at budget
    1 at the model's default price, or the backbone alone where no stage trained one); `sampling`: greedy by default
    (`Sampling(temperature=0.8, top_k=20)` samples). Returns one `TextOutput` per prompt (a list for a list)."""
    if not isinstance(lm, LanguageModel):
        raise ValueError(f"generate_text takes a LanguageModel (prisme.load(path)), got {type(lm).__name__}")
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise ValueError(f"prompt must be a non-empty string or a non-empty list of them, got {prompt!r}")
    ids = [lm.tokenizer.encode(p) for p in prompts]
    out = generate(lm.model, ids, max_new_tokens, policy or Controller(max_budget=lm.deployable_budget),
                   sampling or Sampling())
    texts = []
    for b, p in enumerate(prompts):
        new = lm.tokenizer.decode(out.tokens[b])
        edits = list(out.n_edits[b])
        texts.append(TextOutput(p + new, new, list(out.tokens[b]), edits, sum(edits) / max(1, len(edits)),
                                out.relative_cost, out))
    return texts[0] if isinstance(prompt, str) else texts
