"""BriLLM: a language model that is a fully connected directed graph of tokens.

A signal (length-d vector) flows along the path of the input tokens; at each token u, every edge u→v turns
the signal into y_v = GeLU(x·W[u→v] + b[u→v] + PE), and the next token is the node v whose y_v has the
largest L2 norm (its energy). The energies are the logits. See `BRILLM_SPEC.md` for the exact math.

    BriLLMModel          parameters, graph, and the signal recurrence (returns the signals)
    BriLLMForCausalLM    + candidate energies (logits), the exact or sampled loss, and `generate()`
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.utils import ModelOutput

from .configuration_brillm import BriLLMConfig
from .energy import (
    EdgeGradLink,
    candidate_energies,
    exact_log_partition,
    gather_edges,
    make_plan,
    scatter_logits,
    successor_logits,
    target_energies,
)
from .graph import BigramGraph, build_sparse_graph, check_csr


def positional_encoding(positions: torch.Tensor, d: int, variant: str = "released") -> torch.Tensor:
    """Sinusoidal encoding rows for integer `positions` (any shape) → (..., d), float32.

    "released" multiplies by 10000^(2j/d) (BriLLM0.5's formula); "sinusoidal" divides (the textbook one).
    Computed in float32 as exp(2j·±ln(10000)/d), like the release, so released checkpoints see the same values.
    """
    sign = 1.0 if variant == "released" else -1.0
    freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) * (sign * math.log(10000.0) / d))
    angle = positions.to(torch.float32).unsqueeze(-1) * freq  # (..., ceil(d/2))
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

    def __init__(self, signal, mix_sum, mix_norm, mix_max, length, last_token, seen: int):
        self.signal = signal  # (B, d) signal leaving the last token
        self.mix_sum = mix_sum  # (B, d) Σ exp(p_k − max) · c_k
        self.mix_norm = mix_norm  # (B,)  Σ exp(p_k − max)
        self.mix_max = mix_max  # (B,)  max p_k so far (−inf before the first edge)
        self.length = length  # (B,)  real tokens consumed
        self.last_token = last_token  # (B,)  node the signal sits on
        self.seen = seen  # input columns consumed, padding included (what generate() slices by)

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
        return BriLLMState(*(getattr(self, n).detach() for n in self._tensors()), seen=self.seen)

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
        V, d, P = config.vocab_size, config.node_size, config.num_edge_rows
        self.node_bias = nn.Parameter(torch.empty(V, 1, d))
        self.weights = nn.Parameter(torch.empty(P, d, d))
        self.biases = nn.Parameter(torch.empty(P, 1, d))
        self.positions = nn.Parameter(torch.ones(1, config.max_position_embeddings, 1))
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
        """Edge-table row of every pair source→target: its real edge, or 0 (shared)."""
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
        """PE rows (float32) for integer positions 0..max_positions, from a table built once per device."""
        cfg = self.config
        key = (index.device, cfg.position_encoding, cfg.node_size, cfg.max_position_embeddings)
        if self._pe_cache is None or self._pe_cache[0] != key:
            positions = torch.arange(cfg.max_position_embeddings + 1, device=index.device)
            self._pe_cache = (key, positional_encoding(positions, cfg.node_size, cfg.position_encoding))
        return self._pe_cache[1][index]

    def _too_long(self, longest: int) -> ValueError:
        return ValueError(
            f"sequence of {longest} tokens exceeds max_position_embeddings={self.config.max_position_embeddings} of "
            "this model; shorten the input (or generate fewer tokens), or split the text into blocks of at most "
            f"{self.config.max_position_embeddings} tokens."
        )

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
    def _run_signals(self, input_ids, attention_mask=None, state: BriLLMState | None = None,
                     edge_fetch=None) -> _Signals:
        """`edge_fetch(rows)`, when given, returns the edge rows (w_steps (B, L, d, d), b_steps (B, L, 1, d)) for the
        (B, L) global row ids in place of `gather_edges` on `self.weights` (the source-sharded table, see sharding.py)."""
        mask = self._check_inputs(input_ids, attention_mask, state)
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
        longest = int((index * valid).max()) + 1
        if longest > cfg.max_position_embeddings:
            raise self._too_long(longest)

        # Every edge the signal crosses (token j−1 → token j); the first token of a sequence has none.
        previous = torch.cat([last.unsqueeze(1), tokens[:, :-1]], 1)
        has_edge = valid & (index > 0)
        rows = torch.where(has_edge, self.edge_rows(previous, tokens), torch.zeros_like(tokens))
        if edge_fetch is not None:
            link = None
            w_steps, b_steps = edge_fetch(rows)
        else:
            link = EdgeGradLink() if torch.is_grad_enabled() else None
            w_steps, b_steps = gather_edges(self.weights, self.biases, rows, self.sparse_gradients, link)
        w_steps, b_steps = w_steps.unbind(1), b_steps.unbind(1)
        pe_edge = self._pe(index).to(wdtype).unbind(1)  # PE[i+1] of edge i
        mix_weight = self.positions.view(-1).float()[(index - 1).clamp(0, cfg.max_position_embeddings - 1)].unbind(1)

        first = valid[:, 0] & (index[:, 0] == 0)
        if bool(first.any()):
            start_pe = self._pe(torch.zeros(1, dtype=torch.long, device=device))
            node_bias = F.embedding(tokens[:, 0], _rows(self.node_bias, d), sparse=self.sparse_gradients)
            s0 = F.gelu(1.0 / d + node_bias.float() + start_pe)
            signal = torch.where(first.unsqueeze(1), s0, signal)

        signals = []
        edge_cols = has_edge.any(0).tolist()
        for j in range(L):
            if edge_cols[j]:
                out = F.gelu(torch.bmm(signal.to(wdtype).unsqueeze(1), w_steps[j]).squeeze(1) + b_steps[j] + pe_edge[j])
                new_sum, new_norm, new_max = _mix_in(out.float(), mix_weight[j], mix_sum, mix_norm, mix_max)
                step = has_edge[:, j]
                mix_sum = torch.where(step.unsqueeze(1), new_sum, mix_sum)
                mix_norm = torch.where(step, new_norm, mix_norm)
                mix_max = torch.where(step, new_max, mix_max)
                signal = torch.where(step.unsqueeze(1), mix_sum / mix_norm.clamp_min(1e-30).unsqueeze(1), signal)
            signals.append(signal)

        rows_idx = torch.arange(B, device=device)
        final_token = torch.where(lengths > 0, tokens[rows_idx, (lengths - 1).clamp_min(0)], last)
        new_state = BriLLMState(signal, mix_sum, mix_norm, mix_max, start + lengths, final_token, seen + T)
        return _Signals(tokens, valid, column, index, torch.stack(signals, 1), new_state, link)

    def _decode_step(self, tokens: torch.Tensor, state: BriLLMState) -> _Signals:
        """One new token per row on top of `state`: the decoding hot path, the same math as the general loop."""
        wdtype = self.weights.dtype
        length = state.length
        if int(length.max()) >= self.config.max_position_embeddings:
            raise self._too_long(int(length.max()) + 1)
        rows = self.edge_rows(state.last_token, tokens)
        out = torch.bmm(state.signal.to(wdtype).unsqueeze(1), self.weights[rows]).squeeze(1)
        out = F.gelu(out + self.biases[rows, 0] + self._pe(length).to(wdtype))
        mix = _mix_in(out.float(), self.positions.view(-1).float()[length - 1], state.mix_sum, state.mix_norm,
                      state.mix_max)
        signal = mix[0] / mix[1].unsqueeze(1)
        new_state = BriLLMState(signal, *mix, length + 1, tokens, state.seen + 1)
        ones = torch.ones_like(tokens, dtype=torch.bool).unsqueeze(1)
        return _Signals(tokens.unsqueeze(1), ones, torch.zeros_like(tokens).unsqueeze(1), length.unsqueeze(1),
                        signal.unsqueeze(1), new_state)

    def forward(self, input_ids=None, attention_mask=None, past_key_values=None, use_cache=None, return_dict=None,
                **kwargs):
        run = self._run_signals(input_ids, attention_mask, past_key_values)
        B, T = input_ids.shape
        hidden = run.signals.new_zeros(B, T, self.config.node_size)
        hidden[run.valid.nonzero(as_tuple=True)[0], run.column[run.valid]] = run.signals[run.valid]
        use_cache = self.config.use_cache if use_cache is None else use_cache
        return BriLLMModelOutput(last_hidden_state=hidden, past_key_values=run.state if use_cache else None)


class BriLLMForCausalLM(BriLLMModel, GenerationMixin):
    """BriLLM with its energies as logits, the exact (or the release's sampled) loss, and `generate()`."""

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
        """
        if labels is not None and past_key_values is not None:
            raise ValueError("labels with past_key_values is not supported: score whole sequences.")
        cfg = self.config
        V = cfg.vocab_size
        run = self._run_signals(input_ids, attention_mask, past_key_values)
        B, T = input_ids.shape
        device = input_ids.device
        if (labels is None and return_logits and T == 1 and past_key_values is not None and not output_hidden_states
                and not torch.is_grad_enabled() and run.signals.shape[1] == 1 and bool(run.valid.all())):
            # decoding hot path: one new token per row, every node's energy as its successor, no plan
            indptr, indices = self.csr()
            pe = self._pe(run.index[:, 0] + 1).to(self.weights.dtype)
            logits = successor_logits(run.signals[:, 0].to(self.weights.dtype), pe, self.weights, self.biases,
                                      run.tokens[:, 0], indptr, indices, V)
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
            x, pe, self.weights, self.biases, plan, self.sparse_gradients, link=run.link
        )
        energies, shared = energies.float(), shared.float()
        logits_sorted = None
        if return_logits or (targets is not None and cfg.loss_type == "sampled"):
            logits_sorted = scatter_logits(energies, shared, plan, V)  # (N, V) in plan order

        loss = None
        if targets is not None:
            target = targets[b_idx, j_idx]
            scored = target != -100
            safe_target = torch.where(scored, target, torch.zeros_like(target))
            rows = self.edge_rows(sources, safe_target)
            true_energy = target_energies(energies, shared, plan, safe_target, rows, indptr[sources] + 1)
            if cfg.loss_type == "exact":
                per_position = exact_log_partition(energies, shared, plan, V) - true_energy
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
        }
        return inputs

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
