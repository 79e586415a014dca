"""What both studies' confirmation passes share: their fresh seeds (`seeds_after`, `--confirm-seeds`) and the rule
that restates a verdict from them (`restated`). Which runs decide a verdict, and what passing means, stay each study's
own: the recall study's pass counts of accuracy (`recall_confirm`, `recall_verdict`), the text study's frontier-gap
intervals (`text_confirm`)."""

from __future__ import annotations

from prisme.studies.recall_setup import parse_seeds

RESTATED = {  # (holds on the study's seeds, holds on the fresh seeds) -> the verdict restated
    (True, True): "confirmed", (False, False): "confirmed negative", (True, False): "unstable",
    (False, True): "unstable"}


def seeds_after(seeds: list[int], n: int = 3) -> list[int]:
    """The `n` seeds right after the largest of `seeds`: the default fresh seeds (30-34 -> 35, 36, 37)."""
    return [max(seeds) + i for i in range(1, n + 1)]


def parse_confirm_seeds(text: str | None) -> list[int] | None:
    """`--confirm-seeds 35,36,37` -> [35, 36, 37]; "none" -> [] (no confirmation pass); None: not given. "0" is seed 0,
    as in --seeds."""
    if text is None:
        return None
    if str(text).strip().lower() == "none":
        return []
    return parse_seeds(text, "--confirm-seeds")


def restated(study: bool, fresh: bool) -> str:
    """A claim's verdict from both sets of seeds: "confirmed" where it holds on both, "confirmed negative" where on
    neither, "unstable" where they disagree."""
    return RESTATED[(bool(study), bool(fresh))]


def stable(study: bool, fresh: bool | None) -> bool | None:
    """Whether both sets of seeds agree (None: no fresh set)."""
    return None if fresh is None else bool(study) == bool(fresh)
