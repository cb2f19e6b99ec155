"""Configuration of a BriLLM model: the graph's size and shape, its positional encoding and its loss."""

import dataclasses

import transformers

# The oldest transformers this code runs on: setup.cfg's lower bound (a test keeps the two equal). It is also the
# remote code of every saved folder, which a Hub user imports with whatever transformers they have, so an older
# one gets this message instead of a config that skips its own checks.
MIN_TRANSFORMERS = "5.4.0"
_TOO_OLD = (f"BriLLM needs transformers>={MIN_TRANSFORMERS} (its config is a dataclass with defaults and checks, "
            f"which transformers supports from {MIN_TRANSFORMERS} on); this is transformers "
            f"{transformers.__version__}: pip install -U 'transformers>={MIN_TRANSFORMERS}'.")
try:
    from transformers import PreTrainedConfig
except ImportError as error:  # transformers 4.x calls it PretrainedConfig
    raise ImportError(_TOO_OLD) from error
if not dataclasses.is_dataclass(PreTrainedConfig):  # 5.0-5.3: __post_init__ (defaults, checks) would never run
    raise ImportError(_TOO_OLD)

GRAPHS = ("sparse", "dense")
POSITION_ENCODINGS = ("released", "sinusoidal")
LOSS_TYPES = ("exact", "sampled")
NEGATIVE_SAMPLINGS = ("frequency", "uniform")
START_SIGNALS = ("uniform", "learned")
POSITION_OVERFLOWS = ("error", "extend")


class BriLLMConfig(PreTrainedConfig):
    r"""
    Configuration of [`BriLLMForCausalLM`]. Every token is a node of a directed graph; every edge u→v
    is a `node_size × node_size` matrix plus a bias.

    Args:
        vocab_size (`int`, defaults to 4000):
            Number of nodes V (one per token of the tokenizer).
        node_size (`int`, defaults to 32):
            Neurons per node, d. Every edge is a d×d matrix plus a length-d bias.
        max_position_embeddings (`int`, defaults to 512):
            Number of learned position weights of the energy mix (the trained range). What happens to
            longer inputs is set by `position_overflow`.
        position_overflow (`str`, defaults to `"error"`):
            `"error"`: inputs (and generations) longer than `max_position_embeddings` raise a `ValueError`.
            `"extend"`: any length is read. Edges past the trained range reuse the last learned position
            weight and the positional encoding continues its formula; nothing changes inside the range.
            The state stays O(d) per sequence, so decoding time per token and memory do not grow.
        graph (`str`, defaults to `"sparse"`):
            `"sparse"`: only `num_edges` edges are real (the ones seen in training data, stored in the
            checkpoint in CSR order by source); every other pair u→v uses one shared edge.
            `"dense"`: every ordered pair is a real edge (V² edges; 16.9B parameters at V=4000, d=32).
        num_edges (`int`, *optional*):
            Number of real edges of a sparse graph (at most V²); computed as V² when dense. A sparse config
            without it still builds (every field has a default, as transformers expects of a config), but a
            model cannot be built on it: `BriLLMModel` checks the graph's size (`check_graph_size`).
        position_encoding (`str`, defaults to `"released"`):
            `"released"`: `PE[pos, 2j] = sin(pos * 10000^(2j/d))`, `PE[pos, 2j+1] = cos(...)` exactly as
            BriLLM0.5 was trained (note: it multiplies where the textbook formula divides).
            `"sinusoidal"`: the textbook `pos / 10000^(2j/d)`.
        initializer_range (`float`, defaults to 0.5):
            Edge matrices, edge biases and node biases start uniform in `[-initializer_range,
            initializer_range]`, as in the release. Position weights start at one (see `position_recency`).
        loss_type (`str`, defaults to `"exact"`):
            `"exact"`: cross-entropy over all V nodes (non-real successors share one energy, so the
            cost follows the real successors). `"sampled"`: the release's objective, cross-entropy
            over the true target and `num_negatives` negative targets of the same source.
        num_negatives (`int`, defaults to 400):
            K, the negatives per step of the sampled loss.
        negative_sampling (`str`, defaults to `"frequency"`):
            `"frequency"`: the K most frequent successors of the source in the training bigrams
            (needs a sparse graph, which stores the counts). `"uniform"`: K nodes drawn uniformly.
        start_signal (`str`, defaults to `"uniform"`):
            The signal the first token's node starts from, before its node bias and PE[0]. `"uniform"`: every
            neuron 1/d, as in the release. `"learned"`: a trainable d-vector (`start_signals`), initialised to
            1/d so a fresh learned model computes exactly what the uniform one does; training only it is prompt
            tuning for BriLLM (d numbers per task).
        num_start_signals (`int`, defaults to 1):
            Learned start signals (one per task), chosen per row by the `signal_ids` input (default 0). Only
            with `start_signal="learned"`.
        signal_dropout (`float`, defaults to 0.0):
            Training only (`model.train()`): dropout with this probability on the signal leaving every token, i.e.
            on the x that enters its outgoing edge and its candidate energies (the running mix keeps the undropped
            edge outputs). 0 = the release. A regulariser: each of the many d×d edge matrices otherwise fits the few
            signals that reach it.
        non_edge_bias (`bool`, defaults to False):
            Sparse graphs: give every node a learned energy offset `non_edge_bias[v]` (a V-vector, initialised to 0)
            that a non-successor v adds to the shared energy, so unseen continuations u→v are no longer all alike
            (the release: every non-successor of u gets the one shared energy). Real edges are unchanged; a fresh
            model computes exactly the release's energies. The exact loss only (the sampled loss's negatives do not
            cover the non-successors).
        node_readout (`bool`, defaults to False):
            Give every node v a learned d-vector `node_readout[v]` (initialised to 0) through which it reads the
            signal x arriving at the current node directly: v's logit is the energy its incoming edge delivers plus
            ⟨x, node_readout[v]⟩. An edge learns context only from its own bigram's occurrences; a node's readout
            learns from every occurrence of the node, after any source, real edge or not. A fresh model computes
            exactly the release's energies. The exact loss only (it scores all V nodes).
        edge_backoff (`bool`, defaults to False):
            Give the edges a shared part: edge u→v computes x·(edge_base + W[u→v]) + b[u→v] + PE, with `edge_base` a
            learned d×d matrix (initialised to 0) that every edge (the shared edge too) adds to its own. An edge's own
            matrix learns from its bigram's occurrences only; `edge_base` learns from every edge the signal crosses
            and every candidate it scores, so a rare edge inherits how context moves energies, and the weight decay on
            the edge matrices pulls each edge toward the shared matrix rather than toward zero. A fresh model
            computes exactly the release's energies.
        node_embedding (`bool`, defaults to False):
            Give every node v a learned d-vector `node_embedding[v]` (initialised to 0) that it adds to the edge
            output it passes on: the signal's mix then carries a recency-weighted bag of the recent tokens beside the
            edges' outputs. An edge output is learned from its own bigram's occurrences; a node's vector from every
            occurrence of the node, so the signal keeps what the last few tokens were even where their edges have
            seen too little. A fresh model computes exactly the release's energies.
        count_prior (`bool`, defaults to False):
            Add to every logit a fixed bigram model of the training text: logit(v | u, x) = energy + readout +
            log p(v | u), with p the interpolated absolute-discount (Kneser–Ney-style) bigram model of every bigram
            seen in training, stored as buffers (`count_prior.py`). The learned parts then model what the counts
            miss, from the first step on, and a bigram the pruned graph sends to the shared edge keeps its counts.
            The exact loss only (the prior changes every node's logit). False = the release.
        count_prior_bigrams (`int`, *optional*):
            Number of seen bigrams the count prior stores (set when the prior is built from the data, like
            `num_edges`).
        position_recency (`float`, defaults to 0.0):
            Where the position weights start: p_k = 1 + position_recency·k for the k-th edge, so the signal's
            softmax mix starts weighted toward the latest edges (the weight of an edge k steps back falls by
            e^(−position_recency·k)) instead of a plain average of all of them. 0 = the release's all ones. Only the
            start: the weights are learned either way.
        bos_token_id, eos_token_id, pad_token_id, unk_token_id (`int`, *optional*):
            Special token ids of the tokenizer the graph was built for.
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
        # Only what each field can be checked for on its own: transformers builds `BriLLMConfig()` with no
        # arguments (save_pretrained, generate() and the repr compare against the defaults), so a config must
        # build without a graph. The graph's size is checked where a model is built (`check_graph_size`).
        self.check()

    # `generate()` and other generic code read these names.
    @property
    def hidden_size(self) -> int:
        return self.node_size

    @property
    def num_edge_rows(self) -> int:
        """Rows of the edge tables: the shared edge (row 0) plus the real edges."""
        self.check_graph_size()
        return self.num_edges + 1

    def num_parameters_formula(self) -> int:
        """The paper's count: P·(d² + d) + V·d + max_positions, with P = real edges + 1 (+ d per learned start
        signal)."""
        d = self.node_size
        learned = self.num_start_signals * d if self.start_signal == "learned" else 0
        learned += self.vocab_size if self.non_edge_bias else 0
        learned += self.vocab_size * d if self.node_readout else 0
        learned += d * d if self.edge_backoff else 0
        learned += self.vocab_size * d if self.node_embedding else 0
        return self.num_edge_rows * (d * d + d) + self.vocab_size * d + self.max_position_embeddings + learned

    def check(self):
        """Raise a `ValueError` naming the first invalid field and how to fix it. Checks what the config can be
        judged on by itself; `check_graph_size` adds the graph's size, which a model needs."""
        need = _need  # short name for the many checks below

        def positive_int(name):
            value = getattr(self, name)
            need(_is_int(value) and value > 0, f"{name} must be a positive integer, got {value!r}.")

        for name in ("vocab_size", "node_size", "max_position_embeddings", "num_negatives", "num_start_signals"):
            positive_int(name)
        need(self.vocab_size >= 2, "vocab_size must be at least 2 (a graph needs two nodes).")
        need(self.graph in GRAPHS, f"graph must be one of {GRAPHS}, got {self.graph!r}.")
        if self.num_edges is not None:
            positive_int("num_edges")
        need(self.position_encoding in POSITION_ENCODINGS,
             f"position_encoding must be one of {POSITION_ENCODINGS}, got {self.position_encoding!r}.")
        need(self.position_overflow in POSITION_OVERFLOWS,
             f"position_overflow must be one of {POSITION_OVERFLOWS}, got {self.position_overflow!r}.")
        need(self.loss_type in LOSS_TYPES, f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}.")
        need(self.negative_sampling in NEGATIVE_SAMPLINGS,
             f"negative_sampling must be one of {NEGATIVE_SAMPLINGS}, got {self.negative_sampling!r}.")
        need(self.start_signal in START_SIGNALS,
             f"start_signal must be one of {START_SIGNALS}, got {self.start_signal!r}.")
        need(self.start_signal == "learned" or self.num_start_signals == 1,
             f"num_start_signals={self.num_start_signals} needs start_signal='learned' (the uniform start signal "
             "is a single fixed vector).")
        need(isinstance(self.initializer_range, (int, float)) and self.initializer_range > 0,
             f"initializer_range must be a positive number, got {self.initializer_range!r}.")
        need(isinstance(self.signal_dropout, (int, float)) and not isinstance(self.signal_dropout, bool)
             and 0 <= self.signal_dropout < 1,
             f"signal_dropout must be a probability in [0, 1), got {self.signal_dropout!r}.")
        need(isinstance(self.non_edge_bias, bool), f"non_edge_bias must be True or False, got {self.non_edge_bias!r}.")
        need(not (self.non_edge_bias and self.loss_type == "sampled"),
             "non_edge_bias needs loss_type='exact' (the sampled loss's negatives do not cover the non-successors).")
        need(isinstance(self.node_readout, bool), f"node_readout must be True or False, got {self.node_readout!r}.")
        need(not (self.node_readout and self.loss_type == "sampled"),
             "node_readout needs loss_type='exact' (a readout changes every node's logit, and the sampled loss "
             "scores only its negatives).")
        need(isinstance(self.edge_backoff, bool), f"edge_backoff must be True or False, got {self.edge_backoff!r}.")
        need(isinstance(self.node_embedding, bool),
             f"node_embedding must be True or False, got {self.node_embedding!r}.")
        need(isinstance(self.count_prior, bool), f"count_prior must be True or False, got {self.count_prior!r}.")
        need(not (self.count_prior and self.graph == "dense"),
             "count_prior needs a sparse graph (the prior is built with the graph from the training bigrams).")
        need(not (self.count_prior and self.loss_type == "sampled"),
             "count_prior needs loss_type='exact' (the prior changes every node's logit, and the sampled loss scores "
             "only its negatives).")
        if self.count_prior_bigrams is not None:
            need(_is_int(self.count_prior_bigrams) and self.count_prior_bigrams >= 0,
                 f"count_prior_bigrams must be a non-negative integer, got {self.count_prior_bigrams!r}.")
        need(isinstance(self.position_recency, (int, float)) and not isinstance(self.position_recency, bool)
             and 0 <= self.position_recency <= 1,
             f"position_recency must be a number in [0, 1], got {self.position_recency!r}.")
        if self.loss_type == "sampled":
            need(self.num_negatives < self.vocab_size,
                 f"num_negatives={self.num_negatives} must be smaller than vocab_size={self.vocab_size}.")
            need(not (self.negative_sampling == "frequency" and self.graph == "dense"),
                 "frequency negatives need the bigram counts of a sparse graph; use "
                 "negative_sampling='uniform' with a dense graph.")
        for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            value = getattr(self, name, None)
            ids = value if isinstance(value, (list, tuple)) else [value]
            for token_id in ids:
                need(token_id is None or (_is_int(token_id) and 0 <= token_id < self.vocab_size),
                     f"{name}={value!r} is not a node id in [0, {self.vocab_size}).")

    def check_graph_size(self):
        """Raise a `ValueError` unless the config gives the size of a graph a model can be built on: a sparse
        graph's `num_edges` (at most V²), a dense graph's V². `BriLLMModel` calls it (with `check`) when a model is
        built or loaded; a config alone may lack it (`BriLLMConfig()`)."""
        V, E = self.vocab_size, self.num_edges
        if self.graph == "sparse":
            _need(E is not None,
                  "a sparse graph needs num_edges (build one with BriLLMForCausalLM.from_token_sequences, "
                  "or pass graph='dense').")
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


def _need(ok: bool, message: str):
    if not ok:
        raise ValueError(f"Invalid BriLLMConfig: {message}")


__all__ = ["BriLLMConfig"]
