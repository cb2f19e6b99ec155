"""BriLLM: a language model that is a fully connected directed graph of tokens.

A signal (length-d vector) flows along the path of the input tokens; at each token u, every edge u→v turns
the signal into y_v = GeLU(x·W[u→v] + b[u→v] + PE), and the next token is the node v whose y_v has the
largest L2 norm (its energy). The energies are the logits. See `BRILLM_SPEC.md` for the exact math.

    BriLLMModel          parameters, graph, and the signal recurrence (returns the signals)
    BriLLMForCausalLM    + candidate energies (logits), the exact or sampled loss, and `generate()`
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput, logging

from .backend import exact_precision, use_triton
from .configuration_brillm import BriLLMConfig
from .energy import (
    EdgeGradLink,
    candidate_energies,
    exact_log_partition,
    gather_edges,
    graph_max_degree,
    make_plan,
    scatter_logits,
    successor_logits,
    successor_logits_static,
    target_energies,
)
from .graph import BigramGraph, build_sparse_graph, check_csr, count_bigrams, merge_edges

logger = logging.get_logger(__name__)


def positional_encoding(positions: torch.Tensor, d: int, variant: str = "released") -> torch.Tensor:
    """Sinusoidal encoding rows for integer `positions` (any shape, any non-negative values) → (..., d), float32.

    "released" multiplies by 10000^(2j/d) (BriLLM0.5's formula); "sinusoidal" divides (the textbook one).
    Computed with the release's exact float32 steps (BRILLM_SPEC.md, "Positional encoding"): the angles reach
    pos·5.6e3, so an equal formula that rounds the frequency differently (e.g. exp(2j·ln(10000)/d)) moves
    them by up to 0.25 rad and released checkpoints no longer see the values they were trained on.
    """
    if positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}; pass e.g. torch.arange(n).")
    if variant not in ("released", "sinusoidal"):
        raise ValueError(f"variant must be 'released' or 'sinusoidal', got {variant!r}.")
    exponent = torch.arange(0, d, 2, device=positions.device) / d  # int64 / int → float32 (true division)
    freq = 10000.0 ** exponent  # float32 power, as the release
    pos = positions.to(torch.int64).unsqueeze(-1)
    angle = pos * freq if variant == "released" else pos / freq  # int64 with float32 → float32, (..., ceil(d/2))
    pe = torch.empty(*positions.shape, d, dtype=torch.float32, device=positions.device)
    pe[..., 0::2] = torch.sin(angle)
    pe[..., 1::2] = torch.cos(angle[..., : d // 2])
    return pe


def _mix_in(out, weight_logit, mix_sum, mix_norm, mix_max):
    """Add edge output `out` (B, d) with position weight logit (B,) to the running softmax mix."""
    new_max = torch.maximum(mix_max, weight_logit)
    decay, weight = torch.exp(mix_max - new_max), torch.exp(weight_logit - new_max)
    return mix_sum * decay.unsqueeze(1) + weight.unsqueeze(1) * out, mix_norm * decay + weight, new_max


class _RowView(torch.autograd.Function):
    """`tensor.view(shape)` keeping the first (row) dimension, whose backward also accepts sparse row gradients
    (autograd's own view backward cannot reshape a sparse COO gradient)."""

    @staticmethod
    def forward(ctx, tensor, shape):
        ctx.shape = tensor.shape
        return tensor.view(shape)

    @staticmethod
    def backward(ctx, grad):
        if grad.is_sparse:
            values = grad._values().reshape(-1, *ctx.shape[1:])
            sparse = torch.sparse_coo_tensor(grad._indices(), values, ctx.shape, is_coalesced=grad.is_coalesced(),
                                             check_invariants=False)  # rows come from autograd: valid by construction
            return sparse, None
        return grad.reshape(ctx.shape), None


def _rows(tensor: torch.Tensor, *row_shape: int) -> torch.Tensor:
    """View a parameter as (rows, *row_shape) for row gathers; sparse-gradient safe."""
    return _RowView.apply(tensor, (tensor.shape[0], *row_shape))


class BriLLMState:
    """What a sequence needs to go on: O(d) per sequence, whatever its length.

    The signal entering the next edge is a softmax(positions)-weighted mean of all earlier edge outputs, kept
    as running sums with a running max for stability: x = mix_sum / mix_norm, both scaled by exp(-mix_max).
    """

    def __init__(self, signal, mix_sum, mix_norm, mix_max, length, last_token, seen: int, longest: int | None = None):
        self.signal = signal  # (B, d) signal leaving the last token
        self.mix_sum = mix_sum  # (B, d) Σ exp(p_k − max) · c_k
        self.mix_norm = mix_norm  # (B,)  Σ exp(p_k − max)
        self.mix_max = mix_max  # (B,)  max p_k so far (−inf before the first edge)
        self.length = length  # (B,)  real tokens consumed
        self.last_token = last_token  # (B,)  node the signal sits on
        self.seen = seen  # input columns consumed, padding included (what generate() slices by)
        # host-side bound on length.max() (None = not known yet): lets a decode step check the position range
        # without reading the device
        self.longest = longest
        self.graph_owned = False  # True: the tensors are a captured decode step's buffers (see decode_capture.py)

    def _tensors(self):
        return ("signal", "mix_sum", "mix_norm", "mix_max", "length", "last_token")

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Beam search: keep the rows `beam_idx` (in place)."""
        for name in self._tensors():
            tensor = getattr(self, name)
            setattr(self, name, tensor.index_select(0, beam_idx.to(tensor.device)))
        return self

    def detach(self) -> "BriLLMState":
        return BriLLMState(*(getattr(self, n).detach() for n in self._tensors()), seen=self.seen, longest=self.longest)

    def clone(self) -> "BriLLMState":
        """A copy that owns its tensors (a state returned by a captured decode step lives in the graph's buffers,
        which the next replay overwrites)."""
        return BriLLMState(*(getattr(self, n).clone() for n in self._tensors()), seen=self.seen, longest=self.longest)

    @property
    def batch_size(self) -> int:
        return self.length.shape[0]


@dataclass
class BriLLMModelOutput(ModelOutput):
    """Signals x_t entering the edge that leaves token t (last_hidden_state, (B, T, d)) and the state."""

    last_hidden_state: torch.FloatTensor | None = None
    past_key_values: BriLLMState | None = None


@dataclass
class BriLLMCausalLMOutput(ModelOutput):
    """`logits[:, t]` are the energies of every node as the successor of token t (they predict token t+1)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    past_key_values: BriLLMState | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class _Signals:
    """Compacted view of a batch after the recurrence (real tokens of each row moved to the front)."""

    tokens: torch.Tensor  # (B, L) node ids
    valid: torch.Tensor  # (B, L) real token
    column: torch.Tensor  # (B, L) original input column of each compacted token
    index: torch.Tensor  # (B, L) absolute position of the token in its sequence
    signals: torch.Tensor  # (B, L, d) signal leaving each token
    state: BriLLMState
    link: EdgeGradLink | None = None  # hands the recurrence's edge gradients to candidate_energies


class BriLLMPreTrainedModel(PreTrainedModel):
    config_class = BriLLMConfig
    base_model_prefix = "brillm"
    main_input_name = "input_ids"
    _is_stateful = True  # generate() refuses assisted decoding, which would need to roll the state back

    def _init_weights(self, module):
        if isinstance(module, BriLLMModel):
            r = self.config.initializer_range
            for tensor in (module.node_bias, module.weights, module.biases):
                init.uniform_(tensor, -r, r)
            init.ones_(module.positions)
            if module.start_signals is not None:  # also fills it when a uniform checkpoint is loaded as learned
                init.constant_(module.start_signals, 1.0 / self.config.node_size)
            if module.non_edge_bias is not None:  # zero: the release's energies (also for older checkpoints)
                init.zeros_(module.non_edge_bias)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # BriLLM carries its own O(d) state (`BriLLMState`), not attention key/value caches.
        return False


class BriLLMModel(BriLLMPreTrainedModel):
    """The graph's parameters (names and shapes of the release) and the signal recurrence.

    `node_bias` (V, 1, d); `weights` (P, d, d) and `biases` (P, 1, d) with row 0 the shared edge and rows 1..
    the real edges in CSR order by source; `positions` (1, max_positions, 1) weights of the energy mix. A sparse
    graph also stores its edge list: `graph_indptr` (V+1,), `graph_indices` (E,), `graph_counts` (E,).
    """

    def __init__(self, config: BriLLMConfig):
        super().__init__(config)
        # A config builds without a graph (transformers' convention); a model needs its size. Fields may also
        # have been changed since the config was built, so check them all again here (from_pretrained too).
        config.check()
        config.check_graph_size()
        V, d, P = config.vocab_size, config.node_size, config.num_edge_rows
        self.node_bias = nn.Parameter(torch.empty(V, 1, d))
        self.weights = nn.Parameter(torch.empty(P, d, d))
        self.biases = nn.Parameter(torch.empty(P, 1, d))
        self.positions = nn.Parameter(torch.ones(1, config.max_position_embeddings, 1))
        # start_signal="learned": the signal the first node starts from, one d-vector per task (1/d = the release)
        self.start_signals = None
        if config.start_signal == "learned":
            self.start_signals = nn.Parameter(torch.full((config.num_start_signals, d), 1.0 / d))
        # non_edge_bias=True: a non-successor v of any node gets the shared energy + non_edge_bias[v] (0 = the release)
        self.non_edge_bias = None
        if config.non_edge_bias and config.graph == "sparse":
            self.non_edge_bias = nn.Parameter(torch.zeros(V))
        if config.graph == "sparse":
            E = config.num_edges
            self.register_buffer("graph_indptr", torch.zeros(V + 1, dtype=torch.long))
            self.register_buffer("graph_indices", torch.zeros(E, dtype=torch.long))
            self.register_buffer("graph_counts", torch.zeros(E, dtype=torch.long))
        # Like nn.Embedding(sparse=True): gradients of the edge tables only for the rows a step touched.
        self.sparse_gradients = False
        self._edge_key_cache = self._pe_cache = self._freq_cache = None
        self.post_init()

    # ----------------------------------------------------------------------------------------------- graph
    @classmethod
    def from_graph(cls, graph: BigramGraph | None, config: BriLLMConfig | None = None, **config_kwargs):
        """A freshly initialised model on `graph` (a sparse `BigramGraph`, or None for a dense graph)."""
        if graph is not None and not isinstance(graph, BigramGraph):
            raise TypeError(f"from_graph: graph must be a BigramGraph (or None for a dense graph), got "
                            f"{type(graph).__name__}; build one with modeling_brillm.build_sparse_graph.")
        if config is not None and config_kwargs:
            raise ValueError(f"from_graph: pass either config or config fields, not both (got config and "
                             f"{sorted(config_kwargs)}); set the fields on the config instead.")
        if graph is None and config is not None and config.graph == "sparse":
            raise ValueError("from_graph: a sparse config needs its graph (the BigramGraph of its num_edges real "
                             "edges); pass it, or use a config with graph='dense'.")
        if config is None:
            if graph is None:
                config = BriLLMConfig(graph="dense", **config_kwargs)
            else:
                config = BriLLMConfig(vocab_size=graph.vocab_size, graph="sparse", num_edges=graph.num_edges, **config_kwargs)
        model = cls(config)
        if graph is not None:
            model.set_graph(graph)
        return model

    @classmethod
    def from_token_sequences(cls, sequences, vocab_size: int, min_count: int = 1, dense: bool = False,
                             ignore_ids=(), **config_kwargs):
        """A fresh model whose real edges are the bigrams of `sequences` seen `min_count` times (or dense)."""
        if dense:
            return cls.from_graph(None, vocab_size=vocab_size, **config_kwargs)
        graph = build_sparse_graph(sequences, vocab_size, min_count=min_count, ignore_ids=ignore_ids)
        return cls.from_graph(graph, **config_kwargs)

    def set_graph(self, graph: BigramGraph):
        if self.config.graph != "sparse":
            raise ValueError("set_graph needs a sparse config; a dense graph has every edge.")
        if graph.vocab_size != self.config.vocab_size or graph.num_edges != self.config.num_edges:
            raise ValueError(
                f"graph has V={graph.vocab_size}, E={graph.num_edges} but the config says "
                f"V={self.config.vocab_size}, num_edges={self.config.num_edges}."
            )
        problem = check_csr(graph.indptr, graph.indices, graph.vocab_size)
        if problem:
            raise ValueError(f"malformed graph: {problem}.")
        with torch.no_grad():
            self.graph_indptr.copy_(graph.indptr)
            self.graph_indices.copy_(graph.indices)
            self.graph_counts.copy_(graph.counts)

    def get_graph(self) -> BigramGraph | None:
        if self.config.graph == "dense":
            return None
        return BigramGraph(self.graph_indptr, self.graph_indices, self.graph_counts)

    def check_graph(self):
        """Raise if the stored edge list is malformed or disagrees with the config."""
        if self.config.graph == "sparse":
            problem = check_csr(self.graph_indptr.cpu(), self.graph_indices.cpu(), self.config.vocab_size)
            if problem:
                raise ValueError(
                    f"the checkpoint's edge list does not fit its config (num_edges={self.config.num_edges}): "
                    f"{problem}. The weights file is corrupt or belongs to another config."
                )

    # --------------------------------------------------------------------------------------- growing the graph
    def _replace_parameter(self, name: str, value: torch.Tensor):
        old = getattr(self, name)
        setattr(self, name, nn.Parameter(value, requires_grad=old.requires_grad))

    def resize_token_embeddings(self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None,
                                mean_resizing: bool = True):
        """Add nodes so the graph has one per token of a grown tokenizer (`tokenizer.add_tokens([...])`, then
        `model.resize_token_embeddings(len(tokenizer))`); the Hugging Face call, for a model with no embedding module.

        A new node joins a sparse graph through the shared edge (row 0): every pair involving it is a non-edge until
        `add_edges` makes it real, so the logits of the old nodes do not change. In a dense graph every new pair is a
        real edge, initialised like a fresh model's. The new nodes' start biases (`node_bias`, used when a sequence
        begins at the node) are the mean of the old ones (`mean_resizing=True`) or drawn like a fresh model's.
        `pad_to_multiple_of` rounds the node count up, as in transformers. Shrinking is refused: nodes (and their
        edges) cannot be removed. Parameters are replaced by larger tensors: create the optimizer after resizing.
        Returns None (BriLLM has no embedding module to return).
        """
        V = self.config.vocab_size
        if new_num_tokens is None:
            return None
        if not isinstance(new_num_tokens, int) or isinstance(new_num_tokens, bool):
            raise TypeError(
                f"new_num_tokens must be an int (the tokenizer's len()), got {type(new_num_tokens).__name__}."
            )
        if pad_to_multiple_of is not None:
            if not isinstance(pad_to_multiple_of, int) or pad_to_multiple_of < 1:
                raise ValueError(f"pad_to_multiple_of must be a positive integer, got {pad_to_multiple_of!r}.")
            new_num_tokens = -(-new_num_tokens // pad_to_multiple_of) * pad_to_multiple_of
        if new_num_tokens < V:
            raise ValueError(
                f"resize_token_embeddings({new_num_tokens}) would drop nodes {new_num_tokens}..{V - 1} of this "
                f"{V}-node graph with their edges; BriLLM can only add nodes. Pass at least {V} (len(tokenizer) of "
                "the tokenizer the model was trained with, plus any added tokens)."
            )
        if new_num_tokens == V:
            return None
        d, r = self.config.node_size, self.config.initializer_range
        with torch.no_grad():
            bias = self.node_bias.new_empty(new_num_tokens, 1, d)
            bias[:V] = self.node_bias
            if mean_resizing:
                bias[V:] = self.node_bias.mean(0, keepdim=True)
            else:
                bias[V:].uniform_(-r, r)
            if self.config.graph == "dense":
                # re-lay the V² edge rows (row 1 + u·V + v) for the new V; new pairs start like a fresh model
                old_w, old_b = self.weights[1:].view(V, V, d, d), self.biases[1:].view(V, V, 1, d)
                weights = self.weights.new_empty(1 + new_num_tokens ** 2, d, d).uniform_(-r, r)
                biases = self.biases.new_empty(1 + new_num_tokens ** 2, 1, d).uniform_(-r, r)
                weights[0], biases[0] = self.weights[0], self.biases[0]
                weights[1:].view(new_num_tokens, new_num_tokens, d, d)[:V, :V] = old_w
                biases[1:].view(new_num_tokens, new_num_tokens, 1, d)[:V, :V] = old_b
                self._replace_parameter("weights", weights)
                self._replace_parameter("biases", biases)
                self.config.num_edges = new_num_tokens ** 2
            else:
                # new nodes have no real successors yet: their CSR rows are empty
                indptr = self.graph_indptr
                self.graph_indptr = torch.cat([indptr, indptr[-1:].expand(new_num_tokens - V)])
            self._replace_parameter("node_bias", bias)
        self.config.vocab_size = new_num_tokens
        self._edge_key_cache = self._freq_cache = None
        return None

    def add_edges(self, pairs, counts=None) -> torch.Tensor:
        """Make the pairs u→v (a list of (u, v) or an (N, 2) tensor) real edges of a sparse graph.

        Each new edge starts as a copy of the shared edge that served the pair so far, so no energy (hence no
        prediction) changes until it is trained. `counts` (N,), optional, are their bigram counts (0 otherwise;
        the frequency negatives of the sampled loss read them). Every pair must name existing nodes (grow the graph
        first with `resize_token_embeddings`) and not be a real edge yet (`add_edges_from_sequences` skips those).
        The edge tables are replaced by larger ones: create the optimizer after growing.

        Returns the edge-table rows of the new edges (in the order of `pairs`), e.g. to train only them.
        """
        if self.config.graph != "sparse":
            raise ValueError("add_edges: this graph is dense, so every pair u→v already is a real edge; there is "
                             "nothing to add (only a sparse graph has non-edges).")
        V = self.config.vocab_size
        device = self.graph_indices.device
        if isinstance(pairs, torch.Tensor):
            pairs = pairs.detach().to(device=device)
            if pairs.is_floating_point() or pairs.dtype == torch.bool:
                raise TypeError(f"add_edges: pairs must hold integer node ids, got dtype {pairs.dtype}.")
            pairs = pairs.long()
        else:
            pairs = list(pairs)
            if any(not hasattr(p, "__len__") or len(p) != 2 for p in pairs):
                raise ValueError("add_edges: pairs must be (source, target) node-id pairs, e.g. [(5, 7), (7, 9)].")
            pairs = torch.tensor(pairs, device=device).reshape(-1, 2) if pairs else torch.zeros(0, 2, dtype=torch.long)
            if pairs.is_floating_point() or pairs.dtype == torch.bool:
                raise TypeError(f"add_edges: pairs must hold integer node ids, got {pairs.dtype} values.")
            pairs = pairs.long()
        if pairs.dim() != 2 or pairs.shape[1] != 2:
            raise ValueError(f"add_edges: pairs must have shape (N, 2) (source, target), got {tuple(pairs.shape)}.")
        if pairs.shape[0] == 0:
            return torch.zeros(0, dtype=torch.long, device=device)
        outside = (pairs < 0) | (pairs >= V)
        if bool(outside.any()):
            i = int(outside.any(1).nonzero()[0])
            u, v = pairs[i].tolist()
            raise ValueError(
                f"add_edges: pair ({u}, {v}) names a node outside [0, {V}) of this graph; add the node first "
                "(tokenizer.add_tokens([...]); model.resize_token_embeddings(len(tokenizer)))."
            )
        keys = pairs[:, 0] * V + pairs[:, 1]
        unique_keys, counts_of_key = torch.unique(keys, return_counts=True)
        if bool((counts_of_key > 1).any()):
            key = int(unique_keys[counts_of_key > 1][0])
            raise ValueError(f"add_edges: pair ({key // V}, {key % V}) is listed more than once; list each pair once.")
        real = self.edge_rows(pairs[:, 0], pairs[:, 1]) > 0
        if bool(real.any()):
            shown = ", ".join(f"({u}, {v})" for u, v in pairs[real][:5].tolist())
            raise ValueError(
                f"add_edges: {int(real.sum())} pair(s) already are real edges: {shown}"
                f"{' ...' if int(real.sum()) > 5 else ''}. Drop them, or use add_edges_from_sequences, which skips "
                "them."
            )
        if counts is not None:
            counts = torch.as_tensor(counts, dtype=torch.long, device=device).reshape(-1)
            if counts.numel() != pairs.shape[0]:
                raise ValueError(f"add_edges: counts has {counts.numel()} entries for {pairs.shape[0]} pairs.")
        graph, old_at, new_at = merge_edges(self.get_graph(), pairs[:, 0], pairs[:, 1], counts)
        E, N = self.config.num_edges, pairs.shape[0]
        with torch.no_grad():
            weights = self.weights.new_empty(1 + E + N, *self.weights.shape[1:])
            biases = self.biases.new_empty(1 + E + N, *self.biases.shape[1:])
            weights[0], biases[0] = self.weights[0], self.biases[0]
            weights[1 + old_at], biases[1 + old_at] = self.weights[1:], self.biases[1:]
            weights[1 + new_at], biases[1 + new_at] = self.weights[0], self.biases[0]  # copies of the shared edge
            self._replace_parameter("weights", weights)
            self._replace_parameter("biases", biases)
            self.graph_indptr, self.graph_indices, self.graph_counts = graph.indptr, graph.indices, graph.counts
        self.config.num_edges = E + N
        self._edge_key_cache = self._freq_cache = None
        return 1 + new_at

    def add_edges_from_sequences(self, sequences, min_count: int = 1, ignore_ids=()) -> torch.Tensor:
        """Make real every bigram of the token-id `sequences` seen `min_count` times that is not real yet (with
        its count); returns the new edges' rows (see `add_edges`). `ignore_ids` (padding, say) form no edge."""
        if min_count < 1:
            raise ValueError(f"min_count must be >= 1, got {min_count}.")
        V = self.config.vocab_size
        keys, counts = count_bigrams(sequences, V, ignore_ids)
        keep = counts >= min_count
        keys, counts = keys[keep].to(self.graph_indices.device), counts[keep].to(self.graph_indices.device)
        if self.config.graph == "sparse" and keys.numel():
            fresh = self.edge_rows(keys // V, keys % V) == 0
            keys, counts = keys[fresh], counts[fresh]
        return self.add_edges(torch.stack([keys // V, keys % V], 1), counts)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except RuntimeError as error:
            if "mismatch" not in str(error):
                raise
            raise ValueError(
                f"{pretrained_model_name_or_path}: config.json and the weights disagree in shape (see the report "
                "above): the config's vocab_size / node_size / num_edges / max_position_embeddings must be the ones "
                "the weights were saved with."
            ) from error
        except Exception as error:
            if type(error).__name__ != "SafetensorError":
                raise
            raise OSError(
                f"{pretrained_model_name_or_path}: the weights file is corrupt or incomplete ({error}); save or "
                "download it again."
            ) from error
        model.check_graph()
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        # ship both entry points in auto_map; save_pretrained adds the saved class's own entry
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        auto_map.setdefault("AutoModel", "modeling_brillm.BriLLMModel")
        self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)

    def csr(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(indptr, indices) of the real edges; indices None for a dense graph (every target, in order)."""
        if self.config.graph == "dense":
            V = self.config.vocab_size
            return torch.arange(V + 1, device=self.weights.device) * V, None
        return self.graph_indptr, self.graph_indices

    def edge_rows(self, sources: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Edge-table row of every pair source→target: its real edge, or 0 (shared). On the model's device."""
        sources, targets = self._to_input_device(sources, targets)
        V = self.config.vocab_size
        if self.config.graph == "dense":
            return 1 + sources * V + targets
        indices = self.graph_indices
        key = (indices.data_ptr(), indices._version, self.graph_indptr._version, indices.device)
        if self._edge_key_cache is None or self._edge_key_cache[0] != key:
            src = torch.repeat_interleave(torch.arange(V, device=indices.device), self.graph_indptr.diff())
            self._edge_key_cache = (key, src * V + indices)
        keys = self._edge_key_cache[1]
        if keys.numel() == 0:
            return torch.zeros_like(sources)
        query = sources * V + targets
        pos = torch.searchsorted(keys, query).clamp_max(keys.numel() - 1)
        return torch.where(keys[pos] == query, pos + 1, torch.zeros_like(pos))

    def _pe(self, index: torch.Tensor) -> torch.Tensor:
        """PE rows (float32) for integer positions: 0..max_positions from a table built once per device; past it
        (position_overflow="extend") computed by the same formula, so the cost per row stays flat at any length."""
        cfg = self.config
        M = cfg.max_position_embeddings
        key = (index.device, cfg.position_encoding, cfg.node_size, M)
        if self._pe_cache is None or self._pe_cache[0] != key:
            positions = torch.arange(M + 1, device=index.device)
            self._pe_cache = (key, positional_encoding(positions, cfg.node_size, cfg.position_encoding))
        if cfg.position_overflow != "extend":
            return self._pe_cache[1][index]
        # no host sync: both paths (teacher forcing, one-token decoding) compute rows past M the same way
        rows = self._pe_cache[1][index.clamp_max(M)]
        beyond = positional_encoding(index, cfg.node_size, cfg.position_encoding)
        return torch.where((index > M).unsqueeze(-1), beyond, rows)

    @property
    def extends_positions(self) -> bool:
        """True when the model reads any length (config.position_overflow == "extend")."""
        return self.config.position_overflow == "extend"

    def _too_long(self, longest: int) -> ValueError:
        return ValueError(
            f"sequence of {longest} tokens exceeds max_position_embeddings={self.config.max_position_embeddings} of "
            "this model; shorten the input (or generate fewer tokens), or split the text into blocks of at most "
            f"{self.config.max_position_embeddings} tokens, or set config.position_overflow=\"extend\" to read past "
            "the trained range."
        )

    # ------------------------------------------------------------------------------------------ placement
    @property
    def input_device(self) -> torch.device:
        """Where every input goes: the device of the model's parameters. The one place that decides it, so a
        CPU model given CUDA ids, or a CUDA model given CPU masks, labels or `signal_ids`, computes where its
        weights are (like accelerate's device hooks), instead of failing deep inside on mixed devices."""
        return self.node_bias.device

    def _to_input_device(self, *inputs):
        """`inputs` with every tensor moved to `input_device` (a no-op for those already there); anything else
        (None, lists, wrong types) is returned unchanged for the input checks to judge."""
        device = self.input_device
        return tuple(x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x for x in inputs)

    # ------------------------------------------------------------------------------------------ validation
    def _check_inputs(self, input_ids, attention_mask, state):
        if input_ids is None:
            raise ValueError("input_ids is required: BriLLM reads token ids (it has no input embeddings).")
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.LongTensor of shape (batch, length), got {type(input_ids).__name__}.")
        if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
            raise TypeError(
                f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; convert with input_ids.long() "
                "if they are ids, or tokenize the text first."
            )
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}; add a batch dimension "
                "with input_ids.unsqueeze(0)." if input_ids.dim() == 1 else
                f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}."
            )
        if input_ids.numel() == 0:
            raise ValueError(f"empty input: input_ids has shape {tuple(input_ids.shape)}; give at least one token per row.")
        V = self.config.vocab_size
        low, high = int(input_ids.min()), int(input_ids.max())
        if low < 0 or high >= V:
            bad = low if low < 0 else high
            raise ValueError(
                f"token id {bad} is outside the vocabulary [0, {V}) of this model; use the tokenizer the model was "
                "trained with."
            )
        B, T = input_ids.shape
        if state is not None and state.batch_size != B:
            raise ValueError(f"past_key_values holds {state.batch_size} sequences but input_ids has {B} rows.")
        if attention_mask is None:
            return torch.ones_like(input_ids, dtype=torch.bool)
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or attention_mask.shape[0] != B \
                or attention_mask.shape[1] < T or (state is None and attention_mask.shape[1] != T):
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise ValueError(
                f"attention_mask must have the shape of input_ids {(B, T)} (or cover the past columns too when "
                f"past_key_values is given), got {shape}."
            )
        mask = attention_mask[:, -T:].to(input_ids.device) != 0
        if state is None and not bool(mask.any(1).all()):
            raise ValueError("a row of attention_mask is all zeros: every sequence needs at least one real token.")
        return mask

    # ------------------------------------------------------------------------------------------- recurrence
    def _check_signal_ids(self, signal_ids, batch: int, device) -> torch.Tensor | None:
        """(B,) long start-signal ids on `device`, or None for the uniform start (or no signal_ids on learned)."""
        cfg = self.config
        if signal_ids is None:
            return None
        if cfg.start_signal != "learned":
            raise ValueError("signal_ids needs a model with start_signal='learned' (this one starts every sequence "
                             "from the uniform 1/d signal); set config.start_signal='learned' or drop signal_ids.")
        signal_ids = torch.as_tensor(signal_ids, device=device)
        if signal_ids.dim() == 0:
            signal_ids = signal_ids.expand(batch)
        if signal_ids.is_floating_point() or signal_ids.dtype == torch.bool or tuple(signal_ids.shape) != (batch,):
            raise ValueError(f"signal_ids must be integer ids of shape (batch,) = ({batch},), got "
                             f"{tuple(signal_ids.shape)} {signal_ids.dtype}.")
        n = cfg.num_start_signals
        if signal_ids.numel() and (int(signal_ids.min()) < 0 or int(signal_ids.max()) >= n):
            bad = int(signal_ids.min()) if int(signal_ids.min()) < 0 else int(signal_ids.max())
            raise ValueError(f"signal_ids value {bad} is outside [0, {n}): this model has num_start_signals={n}; "
                             "use an id below it, or build the model with more start signals.")
        return signal_ids.long()

    def _scan_kernel(self, fetched: bool):
        """`triton_recurrence.signal_scan` when the recurrence runs as one Triton scan, else None (the torch loop).

        The backend decides (`backend.use_triton`: Triton for CUDA tensors by default); the loop stays for what the
        kernel does not cover: signal dropout in training, node_size > 128, training non-float32 weights."""
        if not use_triton(self.weights):
            return None
        if self.training and getattr(self.config, "signal_dropout", 0.0):
            return None
        from .triton_recurrence import signal_scan, unsupported_reason

        params = (self.weights, self.biases, self.positions, self.node_bias)
        needs_grad = torch.is_grad_enabled() and (fetched or any(p.requires_grad for p in params))
        return signal_scan if unsupported_reason(self.weights, needs_grad) is None else None

    def _run_signals(self, input_ids, attention_mask=None, state: BriLLMState | None = None,
                     signal_ids=None, edge_fetch=None) -> _Signals:
        """`edge_fetch(rows)`, when given, returns the edge rows (w_steps (B, L, d, d), b_steps (B, L, 1, d)) for the
        (B, L) global row ids in place of `gather_edges` on `self.weights` (the source-sharded table, see sharding.py)."""
        mask = self._check_inputs(input_ids, attention_mask, state)
        # the start signal only matters for a sequence's first token: with a state it is already consumed
        signal_ids = self._check_signal_ids(signal_ids, input_ids.shape[0], input_ids.device) if state is None else None
        if state is not None and input_ids.shape[1] == 1 and not torch.is_grad_enabled() and bool(mask.all()):
            return self._decode_step(input_ids[:, 0], state)
        device, cfg = input_ids.device, self.config
        B, T = input_ids.shape
        d = cfg.node_size
        wdtype = self.weights.dtype

        # Move each row's real tokens to the front, so padding on either side (or holes) is simply skipped.
        lengths = mask.sum(1)
        L = int(lengths.max())
        if bool(mask.all()):
            column = torch.arange(T, device=device).expand(B, T)
        else:
            column = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :L]
        tokens = input_ids.gather(1, column)
        valid = torch.arange(L, device=device) < lengths.unsqueeze(1)
        if state is None:
            start = torch.zeros(B, dtype=torch.long, device=device)
            signal = torch.zeros(B, d, dtype=torch.float32, device=device)
            mix_sum = torch.zeros(B, d, dtype=torch.float32, device=device)
            mix_norm = torch.zeros(B, dtype=torch.float32, device=device)
            mix_max = torch.full((B,), float("-inf"), device=device)
            last = tokens[:, 0]
            seen = 0
        else:
            start, last, seen = state.length, state.last_token, state.seen
            signal, mix_sum, mix_norm, mix_max = state.signal, state.mix_sum, state.mix_norm, state.mix_max
        index = start.unsqueeze(1) + torch.arange(L, device=device)  # absolute position of every token
        if not self.extends_positions:
            longest = int((index * valid).max()) + 1
            if longest > cfg.max_position_embeddings:
                raise self._too_long(longest)

        # Every edge the signal crosses (token j−1 → token j); the first token of a sequence has none.
        previous = torch.cat([last.unsqueeze(1), tokens[:, :-1]], 1)
        has_edge = valid & (index > 0)
        rows = torch.where(has_edge, self.edge_rows(previous, tokens), torch.zeros_like(tokens))
        # One Triton scan over all columns (triton_recurrence.py) when the backend picks Triton; the column loop
        # below is the reference and runs whatever the kernel does not cover.
        scan = self._scan_kernel(edge_fetch is not None)
        if edge_fetch is not None:
            link = None
            w_steps, b_steps = edge_fetch(rows)
        else:
            link = EdgeGradLink() if torch.is_grad_enabled() else None
            if scan is None:
                w_steps, b_steps = gather_edges(self.weights, self.biases, rows, self.sparse_gradients, link)
        pe_edge = self._pe(index).to(wdtype)  # PE[i+1] of edge i, (B, L, d)
        mix_weight = self.positions.view(-1).float()[(index - 1).clamp(0, cfg.max_position_embeddings - 1)]  # (B, L)

        first = valid[:, 0] & (index[:, 0] == 0)
        if state is None or bool(first.any()):  # without a state every row starts here: no need to ask the device
            start_pe = self._pe(torch.zeros(1, dtype=torch.long, device=device))
            node_bias = F.embedding(tokens[:, 0], _rows(self.node_bias, d), sparse=self.sparse_gradients)
            if self.start_signals is None:
                start_signal = 1.0 / d
            else:
                ids = signal_ids if signal_ids is not None else torch.zeros_like(tokens[:, 0])
                start_signal = self.start_signals.float()[ids]
            s0 = F.gelu(start_signal + node_bias.float() + start_pe)
            signal = torch.where(first.unsqueeze(1), s0, signal)

        if scan is not None:
            if edge_fetch is not None:  # the fetched rows are the table: row b·L + j is column j of row b
                table, table_rows = (w_steps.reshape(B * L, d, d), b_steps.reshape(B * L, d)), \
                    torch.arange(B * L, device=device).view(B, L)
                sparse, scan_link = False, None
            else:
                table, table_rows, sparse, scan_link = (self.weights, self.biases), rows, self.sparse_gradients, link
            stacked, mix_sum, mix_norm, mix_max = scan(signal, mix_sum, mix_norm, mix_max, mix_weight, *table,
                                                       table_rows, has_edge, pe_edge, sparse, scan_link)
            signal = stacked[:, -1]
        else:
            w_steps, b_steps = w_steps.unbind(1), b_steps.unbind(1)
            pe_edge, mix_weight = pe_edge.unbind(1), mix_weight.unbind(1)
            # signal_dropout (training only; the scan kernel is not chosen then): the signal leaving each token is
            # dropped out where it is used (its edge and its candidate energies); the state keeps the undropped one
            drop = cfg.signal_dropout if self.training else 0.0
            feed = F.dropout(signal, drop, training=True) if drop else signal
            signals = []
            edge_cols = has_edge.any(0).tolist()
            for j in range(L):
                if edge_cols[j]:
                    out = F.gelu(torch.bmm(feed.to(wdtype).unsqueeze(1), w_steps[j]).squeeze(1) + b_steps[j]
                                 + pe_edge[j])
                    new_sum, new_norm, new_max = _mix_in(out.float(), mix_weight[j], mix_sum, mix_norm, mix_max)
                    step = has_edge[:, j]
                    mix_sum = torch.where(step.unsqueeze(1), new_sum, mix_sum)
                    mix_norm = torch.where(step, new_norm, mix_norm)
                    mix_max = torch.where(step, new_max, mix_max)
                    signal = torch.where(step.unsqueeze(1), mix_sum / mix_norm.clamp_min(1e-30).unsqueeze(1), signal)
                    feed = F.dropout(signal, drop, training=True) if drop else signal
                signals.append(feed)
            stacked = torch.stack(signals, 1)

        rows_idx = torch.arange(B, device=device)
        final_token = torch.where(lengths > 0, tokens[rows_idx, (lengths - 1).clamp_min(0)], last)
        new_state = BriLLMState(signal, mix_sum, mix_norm, mix_max, start + lengths, final_token, seen + T)
        return _Signals(tokens, valid, column, index, stacked, new_state, link)

    def _decode_step(self, tokens: torch.Tensor, state: BriLLMState) -> _Signals:
        """One new token per row on top of `state`: the decoding hot path, the same math as the general loop."""
        wdtype = self.weights.dtype
        length = state.length
        M = self.config.max_position_embeddings
        if not self.extends_positions and int(length.max()) >= M:
            raise self._too_long(int(length.max()) + 1)
        rows = self.edge_rows(state.last_token, tokens)
        out = torch.bmm(state.signal.to(wdtype).unsqueeze(1), self.weights[rows]).squeeze(1)
        out = F.gelu(out + self.biases[rows, 0] + self._pe(length).to(wdtype))
        weight = self.positions.view(-1).float()[(length - 1).clamp_max(M - 1)]  # past the range: the last one
        mix = _mix_in(out.float(), weight, state.mix_sum, state.mix_norm, state.mix_max)
        signal = mix[0] / mix[1].unsqueeze(1)
        new_state = BriLLMState(signal, *mix, length + 1, tokens, state.seen + 1)
        ones = torch.ones_like(tokens, dtype=torch.bool).unsqueeze(1)
        return _Signals(tokens.unsqueeze(1), ones, torch.zeros_like(tokens).unsqueeze(1), length.unsqueeze(1),
                        signal.unsqueeze(1), new_state)

    def _decode_core(self, tokens, signal, mix_sum, mix_norm, mix_max, length, last_token, max_degree: int):
        """`_decode_step` plus the successors' logits with no host synchronisation and fixed shapes: what
        `decode_capture` records into a CUDA graph (and what runs on `device="meta"`). Returns the (B, V) float32
        logits of every node as the successor of `tokens` (B,) and the state tensors after them."""
        cfg = self.config
        M = cfg.max_position_embeddings
        wdtype = self.weights.dtype
        if use_triton(tokens) and self.weights.dtype in (torch.float32, torch.bfloat16, torch.float16):
            from .triton_energy import decode_step  # two launches for the whole step

            indptr, indices = self.csr()
            P = self.biases.shape[0]
            return decode_step(tokens, signal, mix_sum, mix_norm, mix_max, length, last_token, self.weights,
                               self.biases.view(P, -1), self.positions.view(-1), self._pe(length), self._pe(length + 1),
                               indptr, indices, cfg.vocab_size, max_degree, self.non_edge_bias)
        rows = self.edge_rows(last_token, tokens)
        out = torch.bmm(signal.to(wdtype).unsqueeze(1), self.weights[rows]).squeeze(1)
        out = F.gelu(out + self.biases[rows, 0] + self._pe(length).to(wdtype))
        weight = self.positions.view(-1).float()[(length - 1).clamp(0, M - 1)]  # past the range: the last one
        mix_sum, mix_norm, mix_max = _mix_in(out.float(), weight, mix_sum, mix_norm, mix_max)
        signal = mix_sum / mix_norm.unsqueeze(1)
        indptr, indices = self.csr()
        logits = successor_logits_static(signal.to(wdtype), self._pe(length + 1).to(wdtype), self.weights,
                                         self.biases, tokens, indptr, indices, cfg.vocab_size, max_degree,
                                         self.non_edge_bias)
        return logits.float(), (signal, mix_sum, mix_norm, mix_max, length + 1, tokens)

    def _decode_max_degree(self) -> int:
        """Largest real out-degree (static shape of the sync-free step); read from the device once per graph."""
        if self.config.graph == "dense":
            return self.config.vocab_size
        return graph_max_degree(self.graph_indptr)

    @exact_precision
    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, return_dict=None,
                signal_ids=None, **kwargs):
        input_ids, attention_mask, signal_ids = self._to_input_device(input_ids, attention_mask, signal_ids)
        run = self._run_signals(input_ids, attention_mask, past_key_values, signal_ids)
        B, T = input_ids.shape
        hidden = run.signals.new_zeros(B, T, self.config.node_size)
        hidden[run.valid.nonzero(as_tuple=True)[0], run.column[run.valid]] = run.signals[run.valid]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        return BriLLMModelOutput(last_hidden_state=hidden, past_key_values=run.state if use_cache else None)


class BriLLMForCausalLM(BriLLMModel, GenerationMixin):
    """BriLLM with its energies as logits, the exact (or the release's sampled) loss, and `generate()`."""

    # One-token steps on a state (generate(), energy_generate, pipeline, or a direct call):
    #   "auto"   on CUDA the sync-free step (`_decode_core`), captured into a CUDA graph per batch size when called by
    #            the decoding loops (`generation_step=True`), run eagerly otherwise; elsewhere the general path
    #   "eager"  the sync-free step without capture, on any device (what CPU tests compare against "off")
    #   "off"    the general path (`_decode_step` + `successor_logits`), which reads the device for its checks
    decode_mode = "auto"
    # the sync-free step without Triton gathers (rows × max degree) edge matrices; above this many bytes the one-token
    # steps take the general path instead (a dense V = 4000 graph at batch 32 would gather 2 GB)
    padded_decode_bytes = 512 * 2**20

    @exact_precision
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        past_key_values: BriLLMState | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        return_logits: bool = True,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        signal_ids: torch.LongTensor | None = None,
        generation_step: bool = False,
        **kwargs,
    ) -> BriLLMCausalLMOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, length)`): node ids.
        attention_mask (`torch.Tensor`, *optional*): 1 for real tokens, 0 for padding (either side). A padded row
            gives exactly the logits of the row alone at its real positions; padded positions get zero logits.
        labels (`torch.LongTensor`, *optional*): like `input_ids`; `logits[:, t]` is scored against
            `labels[:, t + 1]` (shifted inside, as in every HF causal LM). -100 and padding are ignored.
        past_key_values (`BriLLMState`, *optional*): the state returned by a previous call; `input_ids` then holds
            only the new tokens.
        logits_to_keep (`int`): compute logits for the last this many columns only (0 = all).
        return_logits (`bool`): set False in training to skip building the (batch, length, V) logits.
        signal_ids (`torch.LongTensor` of shape `(batch,)`, *optional*): which learned start signal each row starts
            from (`start_signal="learned"`; default 0). Ignored with `past_key_values` (the start is consumed).
        generation_step (`bool`): set by the decoding loops (generate(), energy_generate) for their one-token steps:
            the new column of `attention_mask` is all ones and the ids are the model's own picks (or a finished row's
            pad token), so the step skips the checks that read the device and may be replayed from a CUDA graph.

        Input tensors may be on any device: they are moved to the model's (`input_device`), where the outputs are.
        """
        if labels is not None and past_key_values is not None:
            raise ValueError("labels with past_key_values is not supported: score whole sequences.")
        input_ids, attention_mask, labels, signal_ids = self._to_input_device(input_ids, attention_mask, labels,
                                                                              signal_ids)
        cfg = self.config
        V = cfg.vocab_size
        if (past_key_values is not None and labels is None and return_logits and not output_hidden_states
                and isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1] == 1
                and not torch.is_grad_enabled() and self._sync_free_decoding(input_ids)):
            out = self._generation_step(input_ids, attention_mask, past_key_values, use_cache, generation_step)
            if out is not None:
                return out
        run = self._run_signals(input_ids, attention_mask, past_key_values, signal_ids)
        B, T = input_ids.shape
        device = input_ids.device
        if (labels is None and return_logits and T == 1 and past_key_values is not None and not output_hidden_states
                and not torch.is_grad_enabled() and run.signals.shape[1] == 1 and bool(run.valid.all())):
            # decoding hot path: one new token per row, every node's energy as its successor, no plan
            indptr, indices = self.csr()
            pe = self._pe(run.index[:, 0] + 1).to(self.weights.dtype)
            logits = successor_logits(run.signals[:, 0].to(self.weights.dtype), pe, self.weights, self.biases,
                                      run.tokens[:, 0], indptr, indices, V, self.non_edge_bias)
            use_cache = cfg.use_cache if use_cache is None else use_cache
            return BriLLMCausalLMOutput(logits=logits.float().unsqueeze(1),
                                        past_key_values=run.state if use_cache else None)

        # Which positions need candidate energies: every real one for the loss; for logits, the last columns.
        targets = None
        if labels is not None:
            if labels.shape != input_ids.shape:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got {tuple(labels.shape)}.")
            shifted = torch.full_like(labels, -100)
            shifted[:, :-1] = labels[:, 1:]
            if attention_mask is not None:
                next_real = torch.zeros_like(shifted, dtype=torch.bool)
                next_real[:, :-1] = attention_mask[:, -T:][:, 1:] != 0
                shifted = torch.where(next_real, shifted, torch.full_like(shifted, -100))
            targets = shifted.gather(1, run.column)  # (B, L) target of each compacted token
            if bool(((targets != -100) & ((targets < 0) | (targets >= V))).any()):
                raise ValueError(f"labels hold ids outside the vocabulary [0, {V}) (use -100 to ignore a position).")
        keep_from = T - logits_to_keep if logits_to_keep and logits_to_keep < T else 0
        wanted = run.valid & (run.column >= keep_from) if return_logits else torch.zeros_like(run.valid)
        if targets is not None:
            wanted = wanted | (run.valid & (targets != -100))
        b_idx, j_idx = wanted.nonzero(as_tuple=True)

        indptr, indices = self.csr()
        sources = run.tokens[b_idx, j_idx]
        plan = make_plan(sources, indptr, indices, V)
        b_idx, j_idx, sources = b_idx[plan.order], j_idx[plan.order], sources[plan.order]
        x = run.signals[b_idx, j_idx].to(self.weights.dtype)
        pe = self._pe(run.index[b_idx, j_idx] + 1).to(self.weights.dtype)
        energies, shared = candidate_energies(
            x, pe, self.weights, self.biases, plan, self.sparse_gradients, link=run.link,
            non_edge_bias=self.non_edge_bias,
        )
        energies, shared = energies.float(), shared.float()
        logits_sorted = None
        if return_logits or (targets is not None and cfg.loss_type == "sampled"):
            logits_sorted = scatter_logits(energies, shared, plan, V, self.non_edge_bias)  # (N, V) in plan order

        loss = None
        if targets is not None:
            target = targets[b_idx, j_idx]
            scored = target != -100
            safe_target = torch.where(scored, target, torch.zeros_like(target))
            rows = self.edge_rows(sources, safe_target)
            true_energy = target_energies(energies, shared, plan, safe_target, rows, indptr[sources] + 1,
                                          self.non_edge_bias)
            if cfg.loss_type == "exact":
                per_position = exact_log_partition(energies, shared, plan, V, self.non_edge_bias) - true_energy
            else:
                per_position = self._sampled_loss(logits_sorted, shared, sources, safe_target)
            count = scored.sum()
            loss = torch.where(scored, per_position, torch.zeros_like(per_position)).sum() / count.clamp_min(1)

        logits = None
        if return_logits:
            width = T - keep_from
            logits = torch.zeros(B, width, V, dtype=torch.float32, device=device)
            if b_idx.numel():
                keep = run.column[b_idx, j_idx] >= keep_from
                logits = logits.index_put(
                    (b_idx[keep], run.column[b_idx, j_idx][keep] - keep_from), logits_sorted[keep]
                )

        use_cache = cfg.use_cache if use_cache is None else use_cache
        hidden = None
        if output_hidden_states:
            hidden_full = run.signals.new_zeros(B, T, cfg.node_size)
            hidden_full[run.valid.nonzero(as_tuple=True)[0], run.column[run.valid]] = run.signals[run.valid]
            hidden = (hidden_full,)
        return BriLLMCausalLMOutput(
            loss=loss, logits=logits, past_key_values=run.state if use_cache else None, hidden_states=hidden
        )

    # ------------------------------------------------------------------------------------- sync-free decoding
    def _sync_free_decoding(self, input_ids) -> bool:
        mode = self.decode_mode
        if mode not in ("auto", "eager", "off"):
            raise ValueError(f"decode_mode must be 'auto', 'eager' or 'off', got {mode!r}.")
        if mode == "off":
            return False
        if not use_triton(input_ids):
            # the torch version gathers every row's padded block: keep its temporary within bounds
            d = self.config.node_size
            gathered = input_ids.shape[0] * self._decode_max_degree() * d * d * self.weights.element_size()
            if gathered > self.padded_decode_bytes:
                return False
        return mode == "eager" or input_ids.is_cuda

    def _generation_step(self, input_ids, attention_mask, state: BriLLMState, use_cache, trusted: bool):
        """One token per row without reading the device (see `decode_mode`); None hands the call back to the
        general path (a padded new column)."""
        cfg = self.config
        B = input_ids.shape[0]
        if not isinstance(state, BriLLMState):
            raise TypeError("past_key_values must be the BriLLMState a previous call returned, got "
                            f"{type(state).__name__}.")
        if trusted:
            if state.batch_size != B:
                raise ValueError(f"past_key_values holds {state.batch_size} sequences but input_ids has {B} rows.")
            # Only a finished row can be fed an id the model did not pick (the pad token, which may lie outside the
            # vocabulary); its state and logits are never used again, so clamping keeps every index in range.
            tokens = input_ids[:, 0].clamp(0, cfg.vocab_size - 1)
        else:
            mask = self._check_inputs(input_ids, attention_mask, state)
            if not bool(mask.all()):
                return None
            tokens = input_ids[:, 0]
        if state.longest is None:
            state.longest = int(state.length.max()) if B else 0  # once per generation; then tracked on the host
        if not self.extends_positions and state.longest >= cfg.max_position_embeddings:
            raise self._too_long(state.longest + 1)
        state_tensors = [getattr(state, name) for name in state._tensors()]
        replayed = None
        if trusted and self.decode_mode == "auto" and input_ids.is_cuda:
            replayed = self._replay_decode_graph(tokens, state)
        captured = replayed is not None
        if captured:
            logits, new_tensors = replayed
        else:
            logits, new_tensors = self._decode_core(tokens, *state_tensors, self._decode_max_degree())
        new_state = BriLLMState(*new_tensors, seen=state.seen + 1, longest=state.longest + 1)
        new_state.graph_owned = captured
        use_cache = cfg.use_cache if use_cache is None else use_cache
        return BriLLMCausalLMOutput(logits=logits.unsqueeze(1), past_key_values=new_state if use_cache else None)

    def _replay_decode_graph(self, tokens, state):
        """The step from its CUDA graph (decode_capture.py): (logits, new state tensors); None where capturing fails,
        said once: this model then decodes with the same step uncaptured (decode_mode becomes "eager")."""
        if getattr(self, "_decode_graphs", None) is None:
            from .decode_capture import DecodeGraphs

            self._decode_graphs = DecodeGraphs()
        try:
            return self._decode_graphs.step(self, tokens, state)
        except RuntimeError as error:  # the capture never ran on this GPU / driver / triton before: keep decoding
            self._decode_graphs.clear()
            self.decode_mode = "eager"
            logger.warning(f"BriLLM: capturing the decode step into a CUDA graph failed ({type(error).__name__}: "
                           f"{str(error).splitlines()[0] if str(error) else ''}); decoding continues with the same "
                           "step uncaptured (model.decode_mode = 'eager', a few times slower per token at batch 1). "
                           "Please report it with your GPU, torch and triton versions.")
            return None

    def _sampled_loss(self, logits, shared, sources, targets):
        """The release's objective: cross-entropy over the true target (first) and K negatives of the source."""
        K = self.config.num_negatives
        if self.config.negative_sampling == "uniform":
            # K distinct nodes other than the target, uniformly
            noise = torch.rand(logits.shape, device=logits.device)
            noise.scatter_(1, targets.unsqueeze(1), -1.0)
            neg_logits = logits.gather(1, noise.topk(K, dim=1).indices)
        else:
            # the K most frequent successors (training bigram counts) other than the target; a source with fewer
            # real successors fills the rest with non-successors, which all carry the shared energy
            table = self._frequency_table(K + 1)[sources]  # (n, K+1), -1 = no further real successor
            drop = table == targets.unsqueeze(1)
            drop[:, -1] |= ~drop.any(1)  # drop the target if listed, else the least frequent
            chosen = table.gather(1, torch.argsort(drop.to(torch.int8), dim=1, stable=True)[:, :K])
            neg_logits = torch.where(chosen < 0, shared.unsqueeze(1), logits.gather(1, chosen.clamp_min(0)))
        scores = torch.cat([logits.gather(1, targets.unsqueeze(1)), neg_logits], 1)
        return torch.logsumexp(scores, 1) - scores[:, 0]

    def _frequency_table(self, width: int) -> torch.Tensor:
        """(V, width) successors of every node by descending bigram count, padded with −1 (cached)."""
        counts, indices = self.graph_counts, self.graph_indices
        key = (width, counts.data_ptr(), counts._version, indices.data_ptr(), indices._version, counts.device)
        cached = self._freq_cache
        if cached is not None and cached[0] == key:
            return cached[1]
        V = self.config.vocab_size
        indptr, indices, counts = self.graph_indptr, self.graph_indices, self.graph_counts
        src = torch.repeat_interleave(torch.arange(V, device=indptr.device), indptr.diff())
        # sort by source, then by count descending, then by target id
        order = torch.argsort(src * (counts.max() + 1 if counts.numel() else 1) - counts, stable=True)
        rank = torch.arange(order.numel(), device=indptr.device) - indptr[src[order]]
        table = torch.full((V, width), -1, dtype=torch.long, device=indptr.device)
        keep = rank < width
        table[src[order][keep], rank[keep]] = indices[order][keep]
        self._freq_cache = (key, table)
        return table

    # -------------------------------------------------------------------------------------------- generate
    def prepare_inputs_for_generation(self, input_ids, past_key_values=None, attention_mask=None, use_cache=None,
                                      logits_to_keep=None, **kwargs):
        if past_key_values is not None:
            # the state has consumed `seen` columns: feed only the new ones
            input_ids = input_ids[:, past_key_values.seen:]
        inputs = {
            "input_ids": input_ids.contiguous(),
            "attention_mask": attention_mask,
            "past_key_values": past_key_values,
            "use_cache": True if use_cache is None else use_cache,
            "logits_to_keep": 1 if logits_to_keep is None else logits_to_keep,
            # generate() appends a column of ones to the mask and feeds its own picks: the step may skip its checks
            "generation_step": past_key_values is not None,
        }
        if past_key_values is None and kwargs.get("signal_ids") is not None:
            inputs["signal_ids"] = kwargs["signal_ids"]  # the first call starts the signal; later ones carry state
        return inputs

    def generate(self, *args, **kwargs):
        # Every tensor argument (ids, attention mask, signal_ids, ...) goes where the model is, as in forward():
        # generate() concatenates the new tokens (made on the model's device) to the prompt, so it must live there.
        args = self._to_input_device(*args)
        kwargs = dict(zip(kwargs, self._to_input_device(*kwargs.values())))
        # remember the prompt's real lengths: padding takes no position, so the length check counts real tokens
        mask = kwargs.get("attention_mask")
        self._prompt_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        try:
            out = super().generate(*args, **kwargs)
        finally:
            self._prompt_mask = None
        state = out.get("past_key_values") if isinstance(out, ModelOutput) else None
        if getattr(state, "graph_owned", False):  # a captured step's buffers: the next generate() overwrites them
            out["past_key_values"] = state.clone()
        return out

    def _prepare_generated_length(self, generation_config, has_default_max_length, has_default_min_length,
                                  model_input_name, input_ids_length, inputs_tensor):
        default_max_length = generation_config.max_length
        generation_config = super()._prepare_generated_length(
            generation_config, has_default_max_length, has_default_min_length, model_input_name, input_ids_length,
            inputs_tensor,
        )
        if self.extends_positions and has_default_max_length and generation_config.max_new_tokens is None:
            # transformers caps the default length at max_position_embeddings; a model that extends has no cap
            generation_config.max_length = default_max_length + input_ids_length
        return generation_config

    def _get_stopping_criteria(self, generation_config, stopping_criteria, *args, **kwargs):
        criteria = super()._get_stopping_criteria(generation_config, stopping_criteria, *args, **kwargs)
        if self.extends_positions:
            for criterion in criteria:  # its "exceeded the model's predefined maximum length" warning does not apply
                if hasattr(criterion, "max_position_embeddings"):
                    criterion.max_position_embeddings = None
        return criteria

    def _validate_generated_length(self, generation_config, input_ids_length, has_default_max_length):
        super()._validate_generated_length(generation_config, input_ids_length, has_default_max_length)
        if self.extends_positions:
            return
        # Refuse before generating (not ~M tokens later): the longest row may not run past the last position.
        M = self.config.max_position_embeddings
        longest = input_ids_length
        mask = getattr(self, "_prompt_mask", None)
        if mask is not None and mask.shape[1] == input_ids_length:
            longest = int((mask != 0).sum(1).max())
        new_tokens = generation_config.max_length - input_ids_length
        if longest > M:
            raise ValueError(
                f"the prompt holds {longest} tokens, more than max_position_embeddings={M} of this model; shorten it "
                f"to at most {M - 1} tokens to leave room for new ones, or set config.position_overflow=\"extend\"."
            )
        if longest + new_tokens > M:
            raise ValueError(
                f"a prompt of {longest} tokens plus max_new_tokens={new_tokens} exceeds max_position_embeddings={M} "
                f"of this model: at most {M - longest} new tokens fit. Lower max_new_tokens, or set "
                "config.position_overflow=\"extend\" to generate past the trained range."
            )

    def _reorder_cache(self, past_key_values: BriLLMState, beam_idx: torch.LongTensor) -> BriLLMState:
        return past_key_values.reorder_cache(beam_idx)

    # ------------------------------------------------------------------------------ BriLLM's own decoding
    def energy_generate(self, input_ids, attention_mask=None, **kwargs):
        """BriLLM's own decoding loop: the next node is the one whose incoming edge delivers the most energy
        (self-loops excluded by default, as in the release), with the energy path recorded. Arguments and result:
        see `decoding.energy_generate`. The standard `generate()` is unchanged."""
        from .decoding import energy_generate

        return energy_generate(self, input_ids, attention_mask=attention_mask, **kwargs)

    def energy_trace(self, text_or_ids, tokenizer=None, top_k: int = 5):
        """Per-step energies, ranks and runner-up nodes of a text's path (see `interpretability.energy_trace`)."""
        from .interpretability import energy_trace

        return energy_trace(self, text_or_ids, tokenizer=tokenizer, top_k=top_k)


__all__ = ["BriLLMPreTrainedModel", "BriLLMModel", "BriLLMForCausalLM", "BriLLMState", "positional_encoding"]
