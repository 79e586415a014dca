"""Model configuration: one dataclass, derived sizes, validation and named presets.

Notation (SPEC §2): V vocab, d backbone width, L layers, w workspace width, M slots per position,
A = M + M/2 controller actions (M single slots, then M/2 disjoint pairs), STOP = A, DENSE = A + 1.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prisme.checks import check_fields
from prisme.io import loads_config

FAMILIES = ("llama", "gpt2")
MAX_MATCH = 32  # the longest common suffix the copy head counts (`prisme.model.bank.suffix`)
COPY_FEATURES = MAX_MATCH + 1 + 8  # the copy head's gate features before its stream's (`prisme.model.copy`)
BANK_KEYS = ("current", "preceding")  # `PrismeConfig.bank_key`


def round_up(x: float, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= x."""
    return int(-(-x // multiple) * multiple)


def reject_unknown_fields(cls: type, d: dict[str, Any], where: str = "") -> None:
    """ValueError naming every key of `d` that is not a field of the dataclass `cls` (and listing the fields)."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"{where}unknown {cls.__name__} field(s) {unknown}; known fields: {sorted(known)}")


def source_layer(term: str, n_layer: int) -> int:
    """The residual-stream depth a canonical source term reads: 0 = embeddings, n_layer = final stream."""
    return 0 if term == "embedding" else n_layer if term == "residual" else int(term.removeprefix("layer"))


@functools.lru_cache(maxsize=256)  # a pure parse, read on every decode step through cfg.bank_terms
def source_terms(spec: str, n_layer: int, field_name: str = "bank_source", where: str = "") -> tuple[str, ...]:
    """Parse a source spec ("residual", "embedding", "layer<i>", or two joined by "+") into canonical term names.

    "layer0" is "embedding" and "layer<L>" is "residual". ValueError naming `field_name` for anything else.
    """
    prefix = f"PrismeConfig({where!r}): " if where else ""
    terms: list[str] = []
    for raw in str(spec).split("+"):
        t = raw.strip()
        if t.startswith("layer") and t[5:].isdigit():
            i = int(t[5:])
            if not 0 <= i <= n_layer:
                raise ValueError(f"{prefix}{field_name}: {t!r} needs 0 <= i <= n_layer={n_layer}")
            t = "embedding" if i == 0 else "residual" if i == n_layer else f"layer{i}"
        if t not in ("residual", "embedding") and not (t.startswith("layer") and t[5:].isdigit()):
            raise ValueError(f"{prefix}{field_name} must be 'residual', 'embedding', 'layer<i>' or two of them joined "
                             f"by '+', got {spec!r}")
        if t in terms:
            raise ValueError(f"{prefix}{field_name} names {t!r} twice: {spec!r}")
        terms.append(t)
    if len(terms) > 2:
        raise ValueError(f"{prefix}{field_name} joins at most two sources, got {spec!r}")
    return tuple(terms)


@dataclass
class PrismeConfig:
    """Everything that defines a PRISME model's shapes. `None` fields are derived in `__post_init__`."""

    name: str = "custom"
    # --- backbone
    family: str = "llama"  # "llama": RMSNorm, RoPE, GQA, SwiGLU, no biases, tied head; "gpt2": LN, learned pos, GELU
    vocab_size: int = 256  # V
    max_seq_len: int = 128  # T_max: positions the backbone (and its caches) can hold
    d_model: int = 64  # d
    n_layer: int = 2  # L
    n_head: int = 4
    n_kv_head: int | None = None  # GQA key/value heads (default: n_head)
    ffn_hidden: int | None = None  # llama: round_up(8d/3, ffn_multiple_of); gpt2: 4d
    ffn_multiple_of: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool | None = None  # default: True for llama, False for gpt2
    init_std: float = 0.02
    key_shift: bool = False  # every attention layer's key also reads the previous position:
    #   k_t = W_k n(x_t) + W_s n(x_{t-1}) (n: the layer's attention-input norm; zero before position 0), the short
    #   convolution that Zoology, H3 and Based put in front of attention
    attn_window: int | None = None  # W: causal sliding-window attention, position t attends to keys t-W+1 .. t; the
    #   decode cache then keeps the last W positions (a ring buffer). None: every earlier position
    # --- workspace
    use_workspace: bool = True  # False: a backbone-only model (e.g. seed001)
    w: int = 64  # workspace width (bank K/V, z, slots)
    n_slots: int = 4  # M (even)
    n_edit_blocks: int = 2
    editor_hidden: int | None = None  # h_e = round_up(8w/3, editor_multiple_of)
    editor_multiple_of: int = 256
    ws_head_dim: int = 64  # editor attention uses w / ws_head_dim heads
    r_max: int = 8  # hard cap on actions per position
    cost_context: int | None = None  # context T at which the controller's price vector is computed (default T_max)
    gate_bias_init: float = 2.0  # editor gate bias at init (sigma(2) ~ 0.88: the path starts open)
    optimised: bool = True  # folded readout keys, the controller projects M slots; False = every op seed 000 counts
    #   (the editor's slot K/V cache is an execution option: `prisme.options.ExecutionOptions.slot_kv_cache`)
    z_norm: bool = True  # z = rms_normalise(P(norm(H))): keeps S0 at a fixed scale so edits stay visible
    ws_init: str = "fan_in"  # workspace weights: "fan_in" (std 1/sqrt(fan_in), slots start alike) or "seed" (init_std)
    # --- what the workspace reads (SPEC §3 source bank; defaults are the seed's)
    bank_source: str = "residual"  # bank K/V from: "residual" (final residual stream H, the seed), "embedding" (the
    #   token embeddings, the input of block 0), "layer<i>" (the stream after i blocks), or two of them joined by "+"
    #   (each term has its own norm and projections; their outputs are summed)
    query_source: str | None = None  # what z (hence S0 and the readout query) reads; default: bank_source
    bank_shift: bool = False  # the key at j also reads position j-1: K_j = W_K n(X_j) + W_K' n(X_{j-1}) (token shift)
    bank_key: str = "current"  # what key j reads: "current" (X_j, and X_{j-1} with bank_shift) or "preceding" (X_{j-1}
    #   alone: K_j = W_K n(X_{j-1}), V_j = W_V n(X_j): a query matching what came before j reads what followed it,
    #   an induction read in one step; `prisme.model.bank.source.KEY_READS`)
    controller_source: str | None = None  # None: the controller's first feature is z (the seed); a source ("residual",
    #   ...): its own projection of that stream instead, so it can see what the workspace's inputs leave out
    controller_bank: bool = False  # the controller also reads how well its position matches the causal bank: two
    #   features, the max and the log-mean-exp of q_c . K_j / sqrt(w) over j < t, with q_c = W_bank z_c (F + 2)
    controller_entropy: bool = False  # ... and the entropy of the backbone's own next-token distribution at the
    #   position, / log V (F + 1): where the backbone is sure, an edit has little to gain
    controller_select: str = "max"  # STOP unless the best ("max", the seed) or the mean ("mean") action score > 0
    router: bool = False  # a per-position router (prisme.model.router) decides step 0 of every policy rollout: which
    #   action, or STOP, from target-free features that cost a few percent of one backbone layer (a linear value head
    #   on norm(H) and whether the current n-gram was seen before); the controller runs only where it fired
    router_ngram: int = 1  # the router also reads whether the last n tokens occurred earlier in the context (n token
    #   comparisons per earlier position, no weights); 0 = its head reads norm(H) only
    router_token: bool = False  # the router also adds a learned value per action of the current token (a [V, A]
    #   table: one lookup and A adds per position): what is at the position, beside what the stream says of it
    # --- the copy head (`prisme.model.copy`): the next token copied from where the context's exact matches
    #   continued, mixed into the head's distribution by a learned gate; dense models and PRISME's backbone alike
    copy_head: bool = False  # the model's logits are log((1 - g) p + g p_copy) wherever a match exists
    copy_min_len: int = 1  # the shortest common suffix (tokens) a position needs to be one the pointer reads
    copy_stream: int = 16  # features of norm(H) the gate reads (a d -> s projection; 0: none)
    copy_hidden: int = 32  # the gate's hidden width
    extra: dict[str, Any] = field(default_factory=dict)  # free-form metadata carried in checkpoints

    def __post_init__(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.tie_embeddings is None:
            self.tie_embeddings = self.family == "llama"
        if self.ffn_hidden is None and isinstance(self.d_model, int) and isinstance(self.ffn_multiple_of, int):
            if self.family == "gpt2":
                self.ffn_hidden = 4 * self.d_model
            elif self.ffn_multiple_of > 0:
                self.ffn_hidden = round_up(8 * self.d_model / 3, self.ffn_multiple_of)
        if self.editor_hidden is None and isinstance(self.w, int) and isinstance(self.editor_multiple_of, int):
            if self.editor_multiple_of > 0:
                self.editor_hidden = round_up(8 * self.w / 3, self.editor_multiple_of)
        if self.cost_context is None:
            self.cost_context = self.max_seq_len
        if self.query_source is None:
            self.query_source = self.bank_source

    # ------------------------------------------------------------------ derived sizes
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    @property
    def n_actions(self) -> int:
        """A: M single-slot actions followed by M/2 disjoint pairs."""
        return self.n_slots + self.n_slots // 2

    @property
    def stop_action(self) -> int:
        return self.n_actions

    @property
    def dense_action(self) -> int:
        return self.n_actions + 1

    @property
    def n_ws_heads(self) -> int:
        return self.w // self.ws_head_dim

    @property
    def controller_features(self) -> int:
        """F = 4w + M + A + r_max + 1 (SPEC §3), + 2 bank-match features with `controller_bank`, + 1 with
        `controller_entropy`."""
        return (4 * self.w + self.n_slots + self.n_actions + self.r_max + 1 + self.n_position_features)

    @property
    def n_position_features(self) -> int:
        """Controller features read once per position before its loop: bank match (2), backbone entropy (1)."""
        return 2 * bool(self.controller_bank) + bool(self.controller_entropy)

    @property
    def use_bias(self) -> bool:
        return self.family == "gpt2"

    @property
    def bank_terms(self) -> tuple[str, ...]:
        """The bank's source terms, canonical names ("residual", "embedding", "layer<i>")."""
        return source_terms(self.bank_source, self.n_layer, "bank_source")

    @property
    def reads_previous(self) -> bool:
        """Whether a bank key reads the position before its own (`bank_shift`, or `bank_key="preceding"`): a decode
        state then remembers each bank term's stream (or token id) at each row's last position."""
        return self.bank_shift or self.bank_key == "preceding"

    @property
    def query_terms(self) -> tuple[str, ...]:
        """z's source terms (canonical names)."""
        return source_terms(self.query_source, self.n_layer, "query_source")

    @property
    def controller_terms(self) -> tuple[str, ...]:
        """The controller's own source (one term), or () when it reads z."""
        if self.controller_source is None:
            return ()
        return source_terms(self.controller_source, self.n_layer, "controller_source")

    @property
    def default_sources(self) -> bool:
        """The seed's workspace inputs: bank and query from the final residual stream, no shift."""
        return (self.bank_terms == ("residual",) and self.query_terms == ("residual",) and not self.bank_shift
                and self.bank_key == "current" and self.controller_source is None and not self.controller_bank
                and not self.controller_entropy)

    # ------------------------------------------------------------------ validation
    def validate(self) -> PrismeConfig:
        """Raise ValueError naming the field for every bad combination; returns self."""

        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"PrismeConfig({self.name!r}): {msg}")

        check_fields(self, f"PrismeConfig({self.name!r}): ")  # bools are bools, floats finite, strings strings
        need(self.family in FAMILIES, f"family must be one of {FAMILIES}, got {self.family!r}")
        need(self.ws_init in ("fan_in", "seed"), f"ws_init must be 'fan_in' or 'seed', got {self.ws_init!r}")
        for f in ("vocab_size", "max_seq_len", "d_model", "n_layer", "n_head", "n_kv_head", "ffn_hidden",
                  "w", "n_slots", "n_edit_blocks", "editor_hidden", "ws_head_dim", "r_max", "cost_context"):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{f} must be a positive int, got {v!r}")
        need(self.d_model % self.n_head == 0, f"d_model={self.d_model} is not divisible by n_head={self.n_head}")
        need(self.n_head % self.n_kv_head == 0, f"n_head={self.n_head} is not divisible by n_kv_head={self.n_kv_head}")
        if self.family == "llama":
            need(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even for RoPE")
        need(self.norm_eps > 0, f"norm_eps must be > 0, got {self.norm_eps}")
        need(self.init_std > 0, f"init_std must be > 0, got {self.init_std}")
        need(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        need(isinstance(self.key_shift, bool), f"key_shift must be a bool, got {self.key_shift!r}")
        need(self.attn_window is None or 1 <= self.attn_window <= self.max_seq_len,
             f"attn_window must be None or an int in [1, max_seq_len={self.max_seq_len}], got {self.attn_window!r}")
        need(isinstance(self.tie_embeddings, bool), f"tie_embeddings must be a bool, got {self.tie_embeddings!r}")
        need(isinstance(self.use_workspace, bool), f"use_workspace must be a bool, got {self.use_workspace!r}")
        need(self.n_slots >= 2 and self.n_slots % 2 == 0, f"n_slots (M) must be even and >= 2, got {self.n_slots}")
        need(self.w % self.ws_head_dim == 0, f"w={self.w} is not divisible by ws_head_dim={self.ws_head_dim}")
        need(self.w % 2 == 0, f"w={self.w} must be even (value and risk heads split it in halves)")
        need(isinstance(self.bank_shift, bool), f"bank_shift must be a bool, got {self.bank_shift!r}")
        need(self.bank_key in BANK_KEYS, f"bank_key must be one of {BANK_KEYS}, got {self.bank_key!r}")
        need(not (self.bank_key == "preceding" and self.bank_shift), "bank_key='preceding' already reads position "
             "j-1: it does not go with bank_shift=True (that would read j-2)")
        need(isinstance(self.controller_bank, bool), f"controller_bank must be a bool, got {self.controller_bank!r}")
        need(self.controller_select in ("max", "mean"), f"controller_select must be 'max' or 'mean', got "
             f"{self.controller_select!r}")
        need(isinstance(self.controller_entropy, bool), f"controller_entropy must be a bool, got "
             f"{self.controller_entropy!r}")
        for f in ("bank_source", "query_source"):
            v = getattr(self, f)
            need(isinstance(v, str), f"{f} must be a string such as 'residual', 'embedding', 'layer1' or "
                 f"'residual+embedding', got {v!r}")
            source_terms(v, self.n_layer, f, self.name)  # ValueError naming the field
        if self.controller_source is not None:
            need(isinstance(self.controller_source, str), f"controller_source must be None or a source string, got "
                 f"{self.controller_source!r}")
            need(len(source_terms(self.controller_source, self.n_layer, "controller_source", self.name)) == 1,
                 f"controller_source reads one stream, got {self.controller_source!r}")
        need(isinstance(self.router, bool), f"router must be a bool, got {self.router!r}")
        need(isinstance(self.router_ngram, int) and not isinstance(self.router_ngram, bool) and self.router_ngram >= 0,
             f"router_ngram must be an int >= 0, got {self.router_ngram!r}")
        need(not self.router or self.use_workspace, "router=True needs a workspace (use_workspace=True)")
        need(isinstance(self.router_token, bool), f"router_token must be a bool, got {self.router_token!r}")
        need(not self.router_token or self.router, "router_token=True needs a router (router=True)")
        need(self.use_workspace or self.bank_key == "current", f"bank_key={self.bank_key!r} configures the workspace's "
             f"bank, but use_workspace=False: drop it, or build the model with a workspace (the other workspace "
             f"fields of a dense model derived from a PRISME config are kept, as its recorded configs hold them)")
        need(isinstance(self.copy_head, bool), f"copy_head must be a bool, got {self.copy_head!r}")
        for f, lo in (("copy_min_len", 1), ("copy_stream", 0), ("copy_hidden", 1)):
            v = getattr(self, f)
            need(isinstance(v, int) and not isinstance(v, bool) and v >= lo, f"{f} must be an int >= {lo}, got {v!r}")
        need(self.copy_min_len <= MAX_MATCH, f"copy_min_len must be at most {MAX_MATCH} (the longest match counted), "
             f"got {self.copy_min_len}")
        return self

    # ------------------------------------------------------------------ serialisation
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrismeConfig:
        """The config of a dict of its fields. A field that has moved out (`MOVED_CONFIG_FIELDS`) is read where it
        holds the value at which it changed nothing; at another value it is a ValueError saying where it went."""
        d, moved = moved_fields(d)
        if moved:
            raise ValueError(f"{sorted(moved)} are no PrismeConfig fields any more: {MOVED_TO} "
                             f"(`prisme.checkpoint.load_model` moves them from an older checkpoint's config.json)")
        reject_unknown_fields(cls, d)
        return cls(**d).validate()

    def to_json(self, path: str | Path | None = None) -> str:
        s = json.dumps(self.to_dict(), indent=2, sort_keys=True)
        if path is not None:
            Path(path).write_text(s + "\n")
        return s

    @classmethod
    def from_json(cls, s_or_path: str | Path) -> PrismeConfig:
        """From a JSON string (an object) or the path of a JSON file."""
        raw = str(s_or_path)
        p = None if isinstance(s_or_path, str) and raw.lstrip()[:1] in ("{", "[") else Path(s_or_path)
        if p is not None and not p.is_file():
            raise ValueError(f"config file {p} does not exist (pass a JSON file or a JSON object string)")
        try:
            text = p.read_bytes().decode("utf-8") if p is not None else raw
        except UnicodeDecodeError as e:
            raise ValueError(f"config file {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None
        try:
            d = loads_config(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"config {p or 'string'} is not valid JSON: {e}") from None
        except ValueError as e:
            raise ValueError(f"config {p or 'string'}: {e}") from None
        if not isinstance(d, dict):
            raise ValueError(f"config {p or 'string'} must hold a JSON object")
        return cls.from_dict(d)

    @classmethod
    def from_name(cls, name: str, **overrides: Any) -> PrismeConfig:
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        d = dict(PRESETS[name])
        d.update(overrides)
        return cls.from_dict({"name": name, **d})

    def diff(self, other: PrismeConfig, ignore: tuple[str, ...] = ("name", "extra")) -> dict[str, tuple]:
        """Fields where two configs differ: {field: (self's value, other's)}."""
        da, db = self.to_dict(), other.to_dict()
        return {k: (da[k], db.get(k)) for k in da if k not in ignore and da[k] != db.get(k)}

    def replace(self, **changes: Any) -> PrismeConfig:
        """A copy with `changes`. A derived field (`DERIVED`) that held its derived value is derived again from the new
        inputs unless `changes` sets it: `replace(d_model=32)` on a d=64 preset gets d=32's `ffn_hidden`, while a
        field the config set explicitly to something else keeps that value."""
        d = self.to_dict()
        derived = PrismeConfig(**{k: v for k, v in d.items() if k not in DERIVED})  # what the inputs alone give
        for k in DERIVED:
            if k not in changes and d[k] == getattr(derived, k):
                d[k] = None
        d.update(changes)
        return PrismeConfig.from_dict(d)


DERIVED = ("n_kv_head", "tie_embeddings", "ffn_hidden", "editor_hidden", "cost_context", "query_source")  # None:
#   derived in __post_init__ from other fields

PRESETS: dict[str, dict[str, Any]] = {
    # Test size: every code path in milliseconds.
    "tiny": dict(vocab_size=64, max_seq_len=64, d_model=32, n_layer=2, n_head=4, n_kv_head=2, ffn_multiple_of=32,
                 w=32, n_slots=4, ws_head_dim=16, editor_multiple_of=32, r_max=4),
    # The CPU demo: byte-level Austen, trains all three stages in minutes on 2 cores. One backbone layer, trained
    # close to what it can learn, so that more backbone tokens buy little and the question is what the bank adds.
    "demo": dict(vocab_size=256, max_seq_len=256, d_model=128, n_layer=1, n_head=4, n_kv_head=2, ffn_multiple_of=64,
                 w=64, n_slots=8, ws_head_dim=32, editor_multiple_of=64, r_max=8),
    # The recall study (MQAR, N=4, V=64, T=32): a one-layer backbone that cannot look a key up, and a workspace whose
    # shifted bank, values and query read the token embeddings; the controller reads H and the bank's best match.
    "recall": dict(vocab_size=64, max_seq_len=32, d_model=64, n_layer=1, n_head=2, n_kv_head=2, ffn_multiple_of=64,
                   w=64, n_slots=4, ws_head_dim=32, editor_multiple_of=64, n_edit_blocks=1, r_max=4,
                   bank_source="embedding", bank_shift=True, controller_source="residual", controller_bank=True),
    # The long-context recall study (`prisme study recall --frontier --context`): the same model, contexts to 4,096.
    "recall_long": dict(vocab_size=64, max_seq_len=4096, d_model=64, n_layer=1, n_head=2, n_kv_head=2,
                        ffn_multiple_of=64, w=64, n_slots=4, ws_head_dim=32, editor_multiple_of=64, n_edit_blocks=1,
                        r_max=4, bank_source="embedding", bank_shift=True, controller_source="residual",
                        controller_bank=True),
    # Seed 001's toy backbone: gpt2-style, 145,280 parameters, no workspace.
    "seed001": dict(family="gpt2", vocab_size=97, max_seq_len=512, d_model=64, n_layer=2, n_head=4,
                    use_workspace=False),
    "prisme_103m": dict(vocab_size=32768, max_seq_len=512, d_model=768, n_layer=12, n_head=12, n_kv_head=3,
                        w=256, n_slots=16, n_edit_blocks=2, r_max=8, cost_context=512),
    "prisme_459m": dict(vocab_size=32768, max_seq_len=4096, d_model=1536, n_layer=16, n_head=24, n_kv_head=6,
                        w=512, n_slots=16, n_edit_blocks=2, r_max=8, cost_context=4096),
}


# PrismeConfig fields added since schema version 1 was written, with the value that reproduces what a checkpoint
# without them computed (the migration table): any other field missing from a config.json is an error, never a
# silent default (a missing `bank_source` would rebuild another model).
ADDED_CONFIG_FIELDS: dict[str, Any] = {"router": False, "router_ngram": 1, "key_shift": False, "attn_window": None,
                                       "router_token": False, "bank_key": "current", "copy_head": False,
                                       "copy_min_len": 1, "copy_stream": 16, "copy_hidden": 32}

# Fields PrismeConfig had and no longer has, each with the value at which it changed nothing: they choose how a decode
# state keeps the bank (`prisme.options.DecodeOptions`), how the editor runs (`prisme.options.ExecutionOptions`) and
# a controller's default price (`prisme.model.policy.Price`), not the model.
# A config dict that holds them (a checkpoint, an export or a study's record written before they moved) still reads:
# `moved_fields` takes them out, and `prisme.checkpoint.load_checkpoint` gives the model it builds those at another
# value (its `decode_options`, `execution`, `default_price`), so that it decodes, runs and prices as before.
MOVED_CONFIG_FIELDS: dict[str, Any] = {"bank_tables": False, "bank_store": "entries", "slot_kv_cache": False,
                                       "lambda_cost": 0.0, "kappa_risk": 0.0}
MOVED_TO = ("bank_tables and bank_store are DecodeOptions (`model.new_decode_state(..., options=DecodeOptions(...))`), "
            "slot_kv_cache an ExecutionOptions (`model.set_execution(ExecutionOptions(slot_kv_cache=True))`), "
            "lambda_cost and kappa_risk a policy's prices (`Controller(lambda_cost=..., kappa_risk=...)`)")


def moved_fields(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`d` without the fields of `MOVED_CONFIG_FIELDS`, those of them it held at another value than the one at which
    they changed nothing)."""
    moved = {k: v for k, v in d.items() if k in MOVED_CONFIG_FIELDS and v != MOVED_CONFIG_FIELDS[k]}
    return {k: v for k, v in d.items() if k not in MOVED_CONFIG_FIELDS}, moved


def current_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A recorded config dict as this version writes it: the fields added since filled in (`with_added_fields`), the
    moved ones dropped where they changed nothing (kept otherwise, so that a comparison with a config of today names
    them: such a record ran something a config alone no longer says)."""
    kept, moved = moved_fields(with_added_fields(d))
    return {**kept, **moved}


def complete_config(d: dict[str, Any], where: Path | str = "config.json") -> dict[str, Any]:
    """A checkpoint's config dict with the fields of `ADDED_CONFIG_FIELDS` filled in where missing; ValueError naming
    every other missing field. Moved fields (`MOVED_CONFIG_FIELDS`) stay: `moved_fields` takes them out."""
    missing = sorted({f.name for f in dataclasses.fields(PrismeConfig)} - set(d) - set(ADDED_CONFIG_FIELDS))
    if missing:
        raise ValueError(f"{where} lacks the field(s) {missing}: the checkpoint's config is incomplete (a default "
                         f"could rebuild another model); restore the file")
    return with_added_fields(d)


def with_added_fields(d: dict[str, Any], added: dict[str, Any] = ADDED_CONFIG_FIELDS) -> dict[str, Any]:
    """A config dict with the fields of `added` (default `ADDED_CONFIG_FIELDS`) it lacks, at the values that
    reproduce what it ran."""
    return {**{k: v for k, v in added.items() if k not in d}, **d}


def untrained_for_policy(cfg: PrismeConfig, groups: set[str], max_budget: int) -> list[str]:
    """The groups a policy with `max_budget` steps would run but no stage trained: the workspace for any edit, the
    router for step 0 of a router model, the controller for its other steps (every step without a router)."""
    if max_budget == 0 or not cfg.use_workspace:
        return []
    need = ["workspace", "router" if cfg.router else "controller"]
    if cfg.router and max_budget > 1:
        need.append("controller")
    return [g for g in need if g not in groups]
