"""Configuration of a BriLLM model: the graph's size and shape, its positional encoding and its loss."""

import dataclasses

import transformers

# setup.cfg's lower bound (a test keeps the two equal): a saved folder's copy on an older transformers says so here
MIN_TRANSFORMERS = "5.4.0"
_TOO_OLD = (f"BriLLM needs transformers>={MIN_TRANSFORMERS} (its config is a dataclass with defaults and checks); this "
            f"is transformers {transformers.__version__}: pip install -U 'transformers>={MIN_TRANSFORMERS}'.")
try:
    from transformers import PreTrainedConfig
except ImportError as error:  # transformers 4.x calls it PretrainedConfig
    raise ImportError(_TOO_OLD) from error
if not dataclasses.is_dataclass(PreTrainedConfig):  # 5.0-5.3: __post_init__ (defaults, checks) would never run
    raise ImportError(_TOO_OLD)

CHOICES = {"graph": ("sparse", "dense"), "position_encoding": ("released", "sinusoidal"),
           "position_overflow": ("error", "extend"), "loss_type": ("exact", "sampled"),
           "negative_sampling": ("frequency", "uniform"), "start_signal": ("uniform", "learned")}
SWITCHES = ("non_edge_bias", "node_readout", "edge_backoff", "node_embedding", "count_prior")
EXACT_ONLY = {  # the extensions the sampled loss cannot train, and why
    "non_edge_bias": "the sampled loss's negatives do not cover the non-successors",
    "node_readout": "a readout changes every node's logit, and the sampled loss scores only its negatives",
    "count_prior": "the prior changes every node's logit, and the sampled loss scores only its negatives",
}


class BriLLMConfig(PreTrainedConfig):
    r"""
    Configuration of [`BriLLMForCausalLM`]; docs/model.md explains each field, `naive.py` marks where each extension
    acts. `BriLLMConfig()` with every extension off is the released BriLLM0.5.

    Args:
        vocab_size (`int`, defaults to 4000): nodes V, one per token of the tokenizer.
        node_size (`int`, defaults to 32): neurons per node, d.
        max_position_embeddings (`int`, defaults to 512): learned position weights of the mix (the trained range).
        position_overflow (`str`, defaults to `"error"`): past the trained range `"error"` refuses, `"extend"` reads on.
        graph (`str`, defaults to `"sparse"`): `"sparse"`: `num_edges` real edges (the bigrams seen in training), every
            other pair shares edge row 0; `"dense"`: every pair is a real edge.
        num_edges (`int`, *optional*): real edges of a sparse graph (V² when dense); a model needs it.
        position_encoding (`str`, defaults to `"released"`): multiplies by 10000^(2j/d); `"sinusoidal"` divides.
        initializer_range (`float`, defaults to 0.5): edges and node biases start uniform in [−r, r].
        loss_type (`str`, defaults to `"exact"`): cross-entropy over all V nodes, or the release's `"sampled"` one
            over the target and `num_negatives` negatives (`negative_sampling`: `"frequency"` or `"uniform"`).
        start_signal (`str`, defaults to `"uniform"`): 1/d (the release), or `"learned"` (`num_start_signals`).
        signal_dropout (`float`, defaults to 0.0): training only, dropout on the signal leaving every token.
        non_edge_bias, node_readout, edge_backoff, node_embedding, count_prior (`bool`, default False): the
            extensions, each starting at the release's energies (`count_prior_bigrams`: the prior's size).
        position_recency (`float`, defaults to 0.0): the position weights start at 1 + position_recency·k.
        edge_rank (`int`, defaults to 0): r > 0 makes each edge edge_base + A·Bᵀ with d×r factors (low_rank.py).
        bos_token_id, eos_token_id, pad_token_id, unk_token_id (`int`, *optional*): the tokenizer's special ids.
    """

    model_type = "brillm"

    vocab_size: int = 4000
    node_size: int = 32
    max_position_embeddings: int = 512
    graph: str = "sparse"
    num_edges: int | None = None
    position_encoding: str = "released"
    position_overflow: str = "error"
    initializer_range: float = 0.5
    loss_type: str = "exact"
    num_negatives: int = 400
    negative_sampling: str = "frequency"
    start_signal: str = "uniform"
    num_start_signals: int = 1
    signal_dropout: float = 0.0
    non_edge_bias: bool = False
    node_readout: bool = False
    edge_backoff: bool = False
    node_embedding: bool = False
    count_prior: bool = False
    count_prior_bigrams: int | None = None
    position_recency: float = 0.0
    edge_rank: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    unk_token_id: int | None = None
    tie_word_embeddings: bool = False
    use_cache: bool = True

    def __post_init__(self, **kwargs):
        if self.graph == "dense" and self.num_edges is None:
            self.num_edges = self.vocab_size * self.vocab_size
        super().__post_init__(**kwargs)
        # each field on its own: transformers builds a bare `BriLLMConfig()`; a model checks the graph's size too
        self.check()

    hidden_size = property(lambda self: self.node_size)  # the name `generate()` and other generic code read

    @property
    def num_edge_rows(self) -> int:
        """Rows of the edge tables: the shared edge (row 0) plus the real edges."""
        self.check_graph_size()
        return self.num_edges + 1

    def num_parameters_formula(self) -> int:
        """The paper's count: P·(d² + d) + V·d + max_positions, with P = real edges + 1, and the extensions'."""
        d, r = self.node_size, self.edge_rank
        learned = self.num_start_signals * d if self.start_signal == "learned" else 0
        learned += self.vocab_size if self.non_edge_bias else 0
        learned += self.vocab_size * d if self.node_readout else 0
        learned += d * d if self.edge_backoff or r else 0
        learned += self.vocab_size * d if self.node_embedding else 0
        edge = 2 * d * r + d if r else d * d + d
        return self.num_edge_rows * edge + self.vocab_size * d + self.max_position_embeddings + learned

    def check(self):
        """Raise a `ValueError` naming the first invalid field and the fix (the graph's size: `check_graph_size`)."""
        for name in ("vocab_size", "node_size", "max_position_embeddings", "num_negatives", "num_start_signals") + \
                (("num_edges",) if self.num_edges is not None else ()):
            value = getattr(self, name)
            _need(_is_int(value) and value > 0, f"{name} must be a positive integer, got {value!r}.")
        _need(self.vocab_size >= 2, "vocab_size must be at least 2 (a graph needs two nodes).")
        for name, choices in CHOICES.items():
            _need(getattr(self, name) in choices, f"{name} must be one of {choices}, got {getattr(self, name)!r}.")
        for name in SWITCHES:
            _need(isinstance(getattr(self, name), bool), f"{name} must be True or False, got {getattr(self, name)!r}.")
        _need(self.start_signal == "learned" or self.num_start_signals == 1,
              f"num_start_signals={self.num_start_signals} needs start_signal='learned' (the uniform start signal "
              "is a single fixed vector).")
        d = self.node_size
        for name, ok, what in (("initializer_range", lambda v: _number(v) and v > 0, "a positive number"),
                               ("signal_dropout", lambda v: _number(v) and 0 <= v < 1, "a probability in [0, 1)"),
                               ("edge_rank", lambda v: _is_int(v) and 0 <= v <= d, f"an integer in [0, node_size={d}]"),
                               ("position_recency", lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
                               ("count_prior_bigrams", lambda v: v is None or (_is_int(v) and v >= 0),
                                "a non-negative integer")):
            _need(ok(getattr(self, name)), f"{name} must be {what}, got {getattr(self, name)!r}.")
        for name, why in EXACT_ONLY.items():
            _need(not (getattr(self, name) and self.loss_type == "sampled"), f"{name} needs loss_type='exact' ({why}).")
        _need(not (self.count_prior and self.graph == "dense"),
              "count_prior needs a sparse graph (the prior is built with the graph from the training bigrams).")
        if self.loss_type == "sampled":
            _need(self.num_negatives < self.vocab_size,
                  f"num_negatives={self.num_negatives} must be smaller than vocab_size={self.vocab_size}.")
            _need(not (self.negative_sampling == "frequency" and self.graph == "dense"), "frequency negatives "
                  "need the bigram counts of a sparse graph; use negative_sampling='uniform' with a dense graph.")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            value = getattr(self, name, None)
            for token_id in value if isinstance(value, (list, tuple)) else [value]:
                _need(token_id is None or (_is_int(token_id) and 0 <= token_id < self.vocab_size),
                      f"{name}={value!r} is not a node id in [0, {self.vocab_size}).")

    def check_graph_size(self):
        """Raise a `ValueError` unless the config sizes a graph a model can be built on (a bare config may not)."""
        V, E = self.vocab_size, self.num_edges
        if self.graph == "sparse":
            _need(E is not None, "a sparse graph needs num_edges (build one with "
                  "BriLLMForCausalLM.from_token_sequences, or pass graph='dense').")
            _need(_is_int(E) and E > 0, f"num_edges must be a positive integer, got {E!r}.")
            _need(E <= V ** 2, f"num_edges={E} exceeds vocab_size**2={V ** 2}.")
        else:
            _need(E == V ** 2, f"a dense graph has vocab_size**2={V ** 2} edges, got num_edges={E}.")
        if self.count_prior:
            K = self.count_prior_bigrams
            _need(K is not None, "count_prior needs count_prior_bigrams, the size of the prior built from the "
                  "training bigrams (build the model with BriLLMForCausalLM.from_token_sequences, or pass "
                  "count_prior=False).")
            _need(K <= V ** 2, f"count_prior_bigrams={K} exceeds vocab_size**2={V ** 2}.")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _need(ok: bool, message: str):
    if not ok:
        raise ValueError(f"Invalid BriLLMConfig: {message}")
