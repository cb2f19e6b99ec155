"""BriLLM: a language model that is a directed graph of tokens (its equations: docs/model.md, naive.py, which this
computes fast). `BriLLMModel` runs the signal recurrence, `BriLLMForCausalLM` adds the candidates' energies (the
logits) and the loss; the hot operations run in ops.py (Triton kernels or torch)."""

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init

from .backend import exact_precision, package_tool
from .configuration_brillm import BriLLMConfig
from .energy import RowView, sparse_rows
from .generation import BriLLMGenerationMixin
from .graph_editing import GraphMethods
from .losses import position_losses, shift_labels
from .low_rank import LowRankEdges
from .ops import EdgeGradLink, candidate_energies, decode_step, graph_max_degree, make_plan, scatter_logits, signal_scan
from .recurrence import check_dropout_rows, plus_edge_base, row_step, scan_dropout_mask
from .state import CACHE, BriLLMCausalLMOutput, BriLLMModelOutput, BriLLMState, Columns, Mix, Signals, given_state
from .tables import DerivedTables, EdgeTable, GraphView, Positions, ReadOut, StepTables, positional_encoding
from .validation import check_inputs, check_labels, check_signal_ids, compact_real_tokens, too_long

# isort: split
# transformers 5.4 copies remote code one import deep: naming the others' imports here makes every file travel.
from .count_prior import CountPrior  # noqa: F401
from .csr import edge_keys  # noqa: F401
from .plans import KernelPlan  # noqa: F401
from .triton_energy import KernelEnergies  # noqa: F401
from .triton_recurrence import unsupported_reason  # noqa: F401


class FullEdges:
    """The release's edges: each row its own matrix and bias, which every path reads in place (`fused`)."""

    fused = True
    row_parameters = ("weights", "biases")  # the parameters indexed by edge row (what sharding splits by source)

    uses = staticmethod(lambda config: True)  # the last of EDGE_KINDS: every config another kind does not take

    @staticmethod
    def create(model, config):
        P, d = config.num_edge_rows, config.node_size
        model.weights = nn.Parameter(torch.empty(P, d, d))
        model.biases = nn.Parameter(torch.empty(P, 1, d))

    @staticmethod
    def init(model, r: float):
        init.uniform_(model.weights, -r, r)
        init.uniform_(model.biases, -r, r)

    # the edges' own matrices (…, d, d) and biases (…, 1, d) from their rows of the row parameters: the rows themselves
    compose = staticmethod(lambda weights, biases: (weights, biases))


EDGE_KINDS = [LowRankEdges, FullEdges]  # the first kind whose `uses(config)` holds makes a model's edges


def initial_positions(config: BriLLMConfig, device=None) -> torch.Tensor:
    """Where the position weights start: p_k = 1 + position_recency·k, (1, max_positions, 1) (all ones: the release)."""
    steps = torch.arange(config.max_position_embeddings, dtype=torch.float32, device=device).view(1, -1, 1)
    return 1.0 + config.position_recency * steps


class BriLLMPreTrainedModel(GraphMethods, PreTrainedModel):
    """Weights initialisation, loading, inputs' placement; the graph's methods come from `GraphMethods`."""

    config_class = BriLLMConfig
    base_model_prefix = "brillm"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _is_stateful = True  # generate() refuses assisted decoding, which would need to roll the state back

    def _init_weights(self, module):
        if isinstance(module, BriLLMModel):
            r = self.config.initializer_range
            init.uniform_(module.node_bias, -r, r)
            module.edges.init(module, r)
            init.copy_(module.positions, initial_positions(self.config, module.positions.device))
            if module.start_signals is not None:  # also fills it when a uniform checkpoint is loaded as learned
                init.constant_(module.start_signals, 1.0 / self.config.node_size)
            for extension in (module.non_edge_bias, module.node_readout, module.edge_base):
                if extension is not None:  # zero: the release's energies (also for older checkpoints)
                    init.zeros_(extension)

    def get_input_embeddings(self):
        """None: a token is a node, its edges hold the parameters (what transformers expects of no embeddings)."""
        return None

    def enable_input_require_grads(self):
        """A no-op: no input embeddings to hook; the checkpointed scan reads the parameters themselves."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):
        try:
            model = super().from_pretrained(pretrained_model_name_or_path, *args, **kwargs)
        except RuntimeError as error:
            if "mismatch" not in str(error):
                raise
            raise ValueError(f"{pretrained_model_name_or_path}: config.json and the weights disagree in shape (see the "
                             "report above): the config's vocab_size / node_size / num_edges / max_position_embeddings "
                             "must be the ones the weights were saved with.") from error
        except Exception as error:
            if type(error).__name__ != "SafetensorError":
                raise
            raise OSError(f"{pretrained_model_name_or_path}: the weights file is corrupt or incomplete ({error}); "
                          "save or download it again.") from error
        model.check_graph()
        for name, param in model.named_parameters():  # NaN weights would generate padding without a word
            bad = 0 if param.device.type == "meta" else int((~torch.isfinite(param)).sum())
            if bad:
                raise ValueError(f"{pretrained_model_name_or_path}: the weights are broken: {name} holds {bad:,} NaN "
                                 f"or infinite value(s) of {param.numel():,}; load an earlier checkpoint or retrain.")
        return model

    def save_pretrained(self, save_directory, *args, **kwargs):
        # ship both entry points in auto_map; save_pretrained adds the saved class's own entry
        auto_map = dict(getattr(self.config, "auto_map", None) or {})
        auto_map.setdefault("AutoModel", "modeling_brillm.BriLLMModel")
        self.config.auto_map = auto_map
        return super().save_pretrained(save_directory, *args, **kwargs)

    @property
    def input_device(self) -> torch.device:
        """Where every input goes: the parameters' device (as accelerate's device hooks), so mixed inputs work."""
        return self.base_model.node_bias.device

    def to_input_device(self, *inputs):
        """`inputs` with every tensor moved to `input_device`; anything else as it is, for the checks to judge."""
        device = self.input_device
        return tuple(x.to(device) if isinstance(x, torch.Tensor) and x.device != device else x for x in inputs)

    extends_positions = property(lambda self: self.config.position_overflow == "extend")  # the model reads any length

    @property
    def sparse_gradients(self) -> bool:
        """As nn.Embedding(sparse=True): the edge tables get gradients for the rows a step touched only."""
        return self.base_model._sparse_gradients

    @sparse_gradients.setter
    def sparse_gradients(self, value: bool):
        self.base_model._sparse_gradients = bool(value)


class BriLLMModel(DerivedTables, BriLLMPreTrainedModel):
    """The parameters (the release's names and shapes, docs/model.md) and the recurrence."""

    def __init__(self, config: BriLLMConfig):
        super().__init__(config)
        config.check()  # again: fields may have changed since the config was built, and a model needs the graph's size
        config.check_graph_size()
        V, d = config.vocab_size, config.node_size
        self.node_bias = nn.Parameter(torch.empty(V, 1, d))
        self.edges = next(kind for kind in EDGE_KINDS if kind.uses(config))
        self.edge_row_parameters = self.edges.row_parameters
        self.edges.create(self, config)
        self.positions = nn.Parameter(torch.ones(1, config.max_position_embeddings, 1))
        # the extensions, each None when off (naive.py marks where each acts)
        learned = config.start_signal == "learned"
        self.start_signals = nn.Parameter(torch.full((config.num_start_signals, d), 1.0 / d)) if learned else None
        sparse_bias = config.non_edge_bias and config.graph == "sparse"
        self.non_edge_bias = nn.Parameter(torch.zeros(V)) if sparse_bias else None
        self.node_readout = nn.Parameter(torch.zeros(V, d)) if config.node_readout else None
        self.edge_base = nn.Parameter(torch.zeros(d, d)) if config.edge_backoff or config.edge_rank else None
        self.node_embedding = nn.Parameter(torch.zeros(V, d)) if config.node_embedding else None
        if config.graph == "sparse":
            self.register_buffer("graph_indptr", torch.zeros(V + 1, dtype=torch.long))
            self.register_buffer("graph_indices", torch.zeros(config.num_edges, dtype=torch.long))
            self.register_buffer("graph_counts", torch.zeros(config.num_edges, dtype=torch.long))
        if config.count_prior:  # the fixed bigram model every logit adds (count_prior.py); zero until it is set
            K, long = config.count_prior_bigrams, torch.long
            for name, empty in (("node", torch.zeros(V)), ("indptr", torch.zeros(V + 1, dtype=long)),
                                ("indices", torch.zeros(K, dtype=long)), ("values", torch.zeros(K))):
                self.register_buffer(f"prior_{name}", empty)
        self._sparse_gradients = False
        self.gradient_checkpointing = False  # transformers' switch: recompute the recurrence in the backward
        self.signal_dropout_scale = 1.0  # the share of config.signal_dropout applied now (pretraining warms it up)
        self.reset_caches()
        self.post_init()

    def edge_table(self) -> EdgeTable:
        return EdgeTable(self.weights, self.biases, self.edge_base, self.non_edge_bias, self._sparse_gradients)

    edge_dtype = property(lambda self: self.biases.dtype)

    def edge_parameters(self, rows: torch.Tensor):
        """The own matrices (…, d, d) and biases (…, 1, d) of edge-table rows `rows` (`edge_base` not added)."""
        return self.edges.compose(*self._fetch_rows(rows))

    def _fetch_rows(self, rows: torch.Tensor):
        """`edge_fetch` of a kind not read in place: its row parameters' rows (sparse under `sparse_gradients`)."""
        take = sparse_rows if self._sparse_gradients else (lambda table, rows: table[rows])
        return tuple(take(getattr(self, name), rows) for name in self.edges.row_parameters)

    def _block_table(self, sources, indptr, indices):
        """A table of the blocks of `sources`' nodes only, materialised (an edge kind the paths cannot read in place):
        (its `EdgeTable`, (indptr, indices) indexing it, the row offset local row = row + offset[source])."""
        V, device = self.config.vocab_size, sources.device
        present = torch.zeros(V, dtype=torch.bool, device=device).index_fill_(0, sources, True)
        degree = torch.where(present, indptr[1:] - indptr[:-1], 0)
        local = torch.cat([degree.new_zeros(1), torch.cumsum(degree, 0)])
        entry = torch.arange(int(local[-1]), device=device)
        node = torch.repeat_interleave(torch.arange(V, device=device), degree, output_size=entry.numel())
        rows = indptr[node] + entry - local[node] + 1  # each entry's row in the model's table
        w, b = self.edge_parameters(torch.cat([rows.new_zeros(1), rows]))
        table = EdgeTable(w, b, self.edge_base, self.non_edge_bias)
        return table, (local, None if indices is None else indices[rows - 1]), local[:-1] - indptr[:-1]

    def graph_view(self) -> GraphView:
        indptr, indices = self.csr()
        host = self.host_csr() if indptr.device.type == "cpu" else None
        return GraphView(indptr, indices, self.edge_keys(), self.config.vocab_size, host)

    def position_table(self, device) -> torch.Tensor:
        """PE rows 0..M (float32), built once per device and config."""
        cfg = self.config
        key = (device, cfg.position_encoding, cfg.node_size, cfg.max_position_embeddings)
        if self._caches.get("pe", (None,))[0] != key:
            positions = torch.arange(cfg.max_position_embeddings + 1, device=device)
            self._caches["pe"] = (key, positional_encoding(positions, cfg.node_size, cfg.position_encoding))
        return self._caches["pe"][1]

    def positions_view(self, device) -> Positions:
        cfg = self.config
        formula = (cfg.node_size, cfg.position_encoding) if self.extends_positions else None
        return Positions(self.position_table(device), self.positions.view(-1).float(), formula)

    def position_encoding(self, index: torch.Tensor) -> torch.Tensor:
        """PE rows (float32) of integer positions."""
        return self.positions_view(index.device).pe(index)

    def mix_weights(self, index: torch.Tensor) -> torch.Tensor:
        """Position weight logits p of the edges entering positions `index` (past the range: the last one)."""
        return self.positions_view(index.device).weight(index)

    def run_signals(self, input_ids, attention_mask=None, state: BriLLMState | None = None, signal_ids=None,
                    edge_fetch=None, dropout_rows=None, dropout_seed: int | None = None) -> Signals:
        """The recurrence over a batch from `state` (if any): 1. the rows' real tokens, 2. the start signal, 3. the scan
        over the crossed edges; `edge_fetch(rows)`: the (w, b) of (B, L) row ids, in place of the tables (sharding)."""
        cfg = self.config
        mask = check_inputs(input_ids, attention_mask, state, cfg.vocab_size)
        if state is None:  # the start signal only matters for a sequence's first token
            signal_ids = check_signal_ids(signal_ids, cfg, input_ids.shape[0], input_ids.device)
        # 1. each row's real tokens moved to the front, with their positions in their sequences
        tokens, valid, column, lengths = compact_real_tokens(input_ids, mask)
        B, L = tokens.shape
        if L == 0:
            raise ValueError("every token of this call is padding (attention_mask 0): there is nothing to run; leave "
                             "the call out, or give each row at least one real token.")
        start, last, seen, mix = (state.length, state.last_token, state.seen, state.mix) if state is not None else \
            (torch.zeros_like(lengths), tokens[:, 0], 0, Mix.empty(B, cfg.node_size, tokens.device))
        index = start.unsqueeze(1) + torch.arange(L, device=tokens.device)
        if not self.extends_positions:
            longest = int((index * valid).max()) + 1
            if longest > cfg.max_position_embeddings:
                raise too_long(longest, cfg.max_position_embeddings)
        # 2. e_0 = GeLU(s + b_node[u_0] + PE_0) for the rows whose first real token starts their sequence
        mix = self._start(tokens, valid & (index == 0), state, signal_ids, mix)
        # 3. every edge the signal crosses (token j−1 → token j; a sequence's first token has none)
        previous = torch.cat([last.unsqueeze(1), tokens[:, :-1]], 1)
        has_edge = valid & (index > 0)
        rows = torch.where(has_edge, self.edge_rows(previous, tokens), torch.zeros_like(tokens))
        node_add = None if self.node_embedding is None else self.node_embedding[tokens]
        columns = Columns(rows, has_edge, self.position_encoding(index).to(self.edge_dtype), self.mix_weights(index),
                          node_add, self._dropout_mask(index, dropout_rows, dropout_seed))
        # the link hands the scan's edge gradients to the candidate energies' backward (one gradient per table)
        link = EdgeGradLink() if torch.is_grad_enabled() and edge_fetch is None else None
        signals, mix = self._scan(mix, columns, edge_fetch, link)
        last_real = tokens[torch.arange(B, device=tokens.device), (lengths - 1).clamp_min(0)]
        new_state = BriLLMState(mix, start + lengths, torch.where(lengths > 0, last_real, last),
                                seen + input_ids.shape[1])
        return Signals(tokens, valid, column, index, signals, new_state, link)

    def _start(self, tokens, first, state, signal_ids, mix: Mix) -> Mix:
        """`mix` with the start signal e_0 as the signal of the rows in `first` (B, L)[:, 0]."""
        first = first[:, 0]
        if state is not None and not bool(first.any()):  # without a state every row starts here: no device read
            return mix
        d = self.config.node_size
        start_pe = self.position_encoding(torch.zeros(1, dtype=torch.long, device=tokens.device))
        rows = RowView.apply(self.node_bias, (self.node_bias.shape[0], d))
        node_bias = F.embedding(tokens[:, 0], rows, sparse=self._sparse_gradients)
        start = 1.0 / d
        if self.start_signals is not None:
            ids = signal_ids if signal_ids is not None else torch.zeros_like(tokens[:, 0])
            start = self.start_signals.float()[ids]
        e0 = F.gelu(start + node_bias.float() + start_pe)
        return Mix(torch.where(first.unsqueeze(1), e0, mix.signal), mix.mix_sum, mix.mix_norm, mix.mix_max)

    def _dropout_mask(self, index, dropout_rows, dropout_seed) -> torch.Tensor | None:
        """The signal dropout's mask (B, L + 1, d) of columns at positions `index` (B, L) in training, else None."""
        p = self.config.signal_dropout * self.signal_dropout_scale if self.training else 0.0
        if not p:
            return None
        # a call that names no seed draws one from torch's generator (reproducible under manual_seed)
        seed = int(torch.randint(-(1 << 63), (1 << 63) - 1, ())) if dropout_seed is None else int(dropout_seed)
        rows = check_dropout_rows(dropout_rows, index.shape[0], index.device)
        return scan_dropout_mask(p, seed, rows, index[:, 0], index.shape, self.config.node_size, index.device)

    def _scan(self, mix: Mix, columns: Columns, edge_fetch, link):
        """The edges along every path (`ops.signal_scan`), recomputed in the backward under gradient checkpointing."""
        if edge_fetch is None and not self.edges.fused:
            edge_fetch, link = self._fetch_rows, None
        edges = self.edge_table() if edge_fetch is None else None
        if edge_fetch is not None:  # the fetched rows are the table: row b·L + j is column j of row b
            B, L = columns.rows.shape
            w, b = self.edges.compose(*edge_fetch(columns.rows))
            edges = EdgeTable(w.reshape(B * L, *w.shape[2:]), b.reshape(B * L, 1, -1), self.edge_base)
            columns.rows = torch.arange(B * L, device=w.device).view(B, L)
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpointed(self._gradient_checkpointing_func, signal_scan, (mix, columns, edges), link)
        return signal_scan(mix, columns, edges, link)

    def step_tables(self) -> StepTables:
        """What the one-token step reads, gathered once (per decoding loop; the config's values included)."""
        return StepTables(self.edge_table(), self.graph_view(), self.positions_view(self.biases.device),
                          self.node_embedding, self.read_out_tables())

    def decode_step(self, tokens: torch.Tensor, state: BriLLMState, width: int | None = None,
                    tables: StepTables | None = None):
        """The one-token step: (logits (B, V) after `tokens` (B,), the new state). `width`: None reads each row's
        degree, the graph's largest reads nothing from the device. One CPU row looks up on the host (`row_step`)."""
        tables = self.step_tables() if tables is None else tables
        if tables.graph.host is not None and tokens.numel() == 1:
            logits, new_state = row_step(tokens, state, tables)
        else:
            logits, mix = decode_step(tokens, state.mix, tables.at(state, tokens), tables.edges, tables.graph, width)
            new_state = state.advanced(mix, tokens)
        return tables.read_out(logits, new_state.signal, tokens), new_state

    def read_out_tables(self) -> ReadOut:
        """What every node adds to its energy: the read of the signal (config.node_readout), the count prior."""
        if not self.config.count_prior:
            return ReadOut(self.node_readout)
        table = self.prior_table()
        csr = (self.prior_node, self.prior_indptr, self.prior_indices, self.prior_values)
        return ReadOut(self.node_readout, (table,) if table is not None else (*csr, graph_max_degree(csr[1])))

    @property
    def scores_every_node(self) -> bool:
        """A part of the logits differs across non-successors (readout, count prior): the loss builds all V logits."""
        return self.node_readout is not None or self.config.count_prior

    def score(self, x, sources, next_index, targets=None, *, want_logits=False, loss_type=None, link=None,
              csr=None, row_offset=None):
        """Energies of positions with signals `x` (N, d) on `sources` (N,), next token at `next_index`: (order,
        per-position losses or None, logits (N, V) or None) in `order` (by source). `targets` (N,): -100 where unscored.
        `csr`, `row_offset` (V,): a table of some sources' blocks (the sharded trainer's: row + row_offset[source])."""
        cfg, V, wdtype = self.config, self.config.vocab_size, self.edge_dtype
        indptr, indices = csr if csr is not None else self.csr()
        edges = self.edge_table() if self.edges.fused else None
        if edges is None:  # an edge kind read through its materialised blocks
            edges, (indptr, indices), offset = self._block_table(sources, indptr, indices)
            row_offset, link = offset if row_offset is None else row_offset + offset, None
        plan = make_plan(sources, indptr, indices, V)
        sources, x = sources[plan.order], x[plan.order].to(wdtype)
        # x·edge_base is one product per position: it rides in PE, whose gradient the candidate backward returns
        pe = plus_edge_base(self.position_encoding(next_index[plan.order]).to(wdtype), x, self.edge_base)
        energies, shared = candidate_energies(x, pe, edges.weights, edges.biases, plan, edges.sparse_grad,
                                              link=link, non_edge_bias=self.non_edge_bias)
        energies, shared = energies.float(), shared.float()
        sampled = targets is not None and (loss_type or cfg.loss_type) == "sampled"
        logits = None
        if want_logits or sampled or self.scores_every_node:
            logits = self.read_out_tables()(scatter_logits(energies, shared, plan, V, self.non_edge_bias), x, sources)
        if targets is None:
            return plan.order, None, logits
        targets = targets[plan.order]
        scored = targets != -100
        targets = torch.where(scored, targets, torch.zeros_like(targets))
        if self.scores_every_node:
            per_position = F.cross_entropy(logits, targets, reduction="none")
        else:
            rows = self.edge_rows(sources, targets)
            if row_offset is not None:
                rows = torch.where(rows > 0, rows + row_offset[sources], rows)
            by_count = self.frequency_table(cfg.num_negatives + 1) \
                if sampled and cfg.negative_sampling == "frequency" else None
            per_position = position_losses(energies, shared, plan, sources, targets, rows, indptr[sources] + 1, cfg,
                                           self.non_edge_bias, logits, by_count, loss_type)
        return plan.order, torch.where(scored, per_position, torch.zeros_like(per_position)), logits

    @exact_precision
    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, return_dict=None,
                signal_ids=None, past_key_values=None, dropout_rows=None, dropout_seed=None, **kwargs):
        input_ids, attention_mask, signal_ids = self.to_input_device(input_ids, attention_mask, signal_ids)
        run = self.run_signals(input_ids, attention_mask, given_state(cache, past_key_values), signal_ids,
                               dropout_rows=dropout_rows, dropout_seed=dropout_seed)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        return BriLLMModelOutput(last_hidden_state=run.scatter(input_ids.shape[1]),
                                 **{CACHE: run.state if use_cache else None})


class BriLLMForCausalLM(BriLLMPreTrainedModel, BriLLMGenerationMixin):
    """BriLLM with its energies as logits, the exact (or the release's sampled) loss, and `generate()`."""

    def __init__(self, config: BriLLMConfig):
        super().__init__(config)
        self.brillm = BriLLMModel(config)
        self.post_init()

    @exact_precision
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                labels: torch.LongTensor | None = None, cache: BriLLMState | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0, return_logits: bool = True, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, signal_ids: torch.LongTensor | None = None,
                generation_step: bool = False, past_key_values: BriLLMState | None = None,
                dropout_rows: torch.LongTensor | None = None, dropout_seed: int | None = None,
                **kwargs) -> BriLLMCausalLMOutput:
        r"""
        input_ids (`torch.LongTensor` of shape `(batch, length)`): node ids.
        attention_mask (`torch.Tensor`, *optional*): 1 for real tokens, 0 for padding (either side): logits as unpadded.
        labels (`torch.LongTensor`, *optional*): like `input_ids`, shifted inside (`logits[:, t]` is scored against
            `labels[:, t + 1]`); -100 and padding are ignored.
        cache (`BriLLMState`, *optional*): the state a previous call returned (`output.state`); `input_ids` then
            holds only the new tokens. `past_key_values` is the same argument under its name before transformers 5.24.
        logits_to_keep (`int`): compute logits for the last this many columns only (0 = all).
        return_logits (`bool`): set False in training to skip building the (batch, length, V) logits.
        signal_ids (`torch.LongTensor` of shape `(batch,)`, *optional*): each row's learned start signal (default 0).
        generation_step (`bool`): set by the decoding loop for its one-token steps (the new mask column is all ones,
            the ids its own picks), which skip the checks that read the device and may replay a CUDA graph.
        dropout_rows (`torch.LongTensor` of shape `(batch,)`, *optional*): global batch indices (signal dropout).
        dropout_seed (`int`, *optional*): the masks' seed, one per step on every process; default: drawn from torch.

        Input tensors may be on any device: they are moved to the model's (`input_device`), where the outputs are.
        """
        state = given_state(cache, past_key_values)
        if labels is not None and state is not None:
            raise ValueError("labels with a cache (a previous call's state) are not supported: score whole sequences.")
        input_ids, attention_mask, labels, signal_ids = self.to_input_device(input_ids, attention_mask, labels,
                                                                             signal_ids)
        use_cache = self.config.use_cache if use_cache is None else use_cache
        # 1. one new token per row on a state, nothing to learn: the one-token step (generation.py)
        if (state is not None and labels is None and return_logits and not output_hidden_states
                and not torch.is_grad_enabled() and self.steps_one_token(input_ids)):
            stepped = self.generation_step(input_ids, attention_mask, state, generation_step)
            if stepped is not None:
                logits, new_state = stepped
                return BriLLMCausalLMOutput(logits=logits.unsqueeze(1), **{CACHE: new_state if use_cache else None})
        # 2. the start signal and the scan over every edge of every path
        run = self.brillm.run_signals(input_ids, attention_mask, state, signal_ids, dropout_rows=dropout_rows,
                                      dropout_seed=dropout_seed)
        T = input_ids.shape[1]
        targets = None
        if labels is not None:
            check_labels(labels, input_ids)
            targets = shift_labels(labels, attention_mask, run.column, self.config.vocab_size)
        # 3. the energies of every candidate (4. and the loss, where there are targets)
        keep_from = T - logits_to_keep if logits_to_keep and logits_to_keep < T else 0
        loss, logits = self._energies(run, targets, keep_from if return_logits else None, T,
                                      kwargs.get("num_items_in_batch"))
        hidden = (run.scatter(T),) if output_hidden_states else None
        return BriLLMCausalLMOutput(loss=loss, logits=logits, hidden_states=hidden,
                                    **{CACHE: run.state if use_cache else None})

    def _energies(self, run: Signals, targets, keep_from: int | None, width: int, num_items=None):
        """(loss or None, logits (B, T − keep_from, V) or None) of the positions with a target, the columns from
        `keep_from` on; the loss is the scored positions' mean, or their sum over `num_items` (`num_items_in_batch`)."""
        V = self.config.vocab_size
        wanted = run.valid & (run.column >= keep_from) if keep_from is not None else torch.zeros_like(run.valid)
        if targets is not None:
            wanted = wanted | (run.valid & (targets != -100))
        b_idx, j_idx = wanted.nonzero(as_tuple=True)
        target = targets[b_idx, j_idx] if targets is not None else None
        order, per_position, logits = self.brillm.score(run.signals[b_idx, j_idx], run.tokens[b_idx, j_idx],
                                                        run.index[b_idx, j_idx] + 1, target,
                                                        want_logits=keep_from is not None, link=run.link)
        b_idx, j_idx = b_idx[order], j_idx[order]
        loss = None
        if per_position is not None:
            count = (target != -100).sum().clamp_min(1) if num_items is None else num_items
            loss = per_position.sum() / torch.as_tensor(count).to(per_position.device)
        if keep_from is None:
            return loss, None
        out = torch.zeros(run.tokens.shape[0], width - keep_from, V, dtype=torch.float32, device=run.signals.device)
        if b_idx.numel():
            column = run.column[b_idx, j_idx]
            keep = column >= keep_from
            out = out.index_put((b_idx[keep], column[keep] - keep_from), logits[keep])
        return loss, out

    def energy_generate(self, input_ids, attention_mask=None, **kwargs):
        """BriLLM's own decoding with its energy path recorded (`modeling_brillm.energy_generate`, a package tool)."""
        return package_tool("decoding", "energy_generate").energy_generate(self, input_ids,
                                                                            attention_mask=attention_mask, **kwargs)

    def energy_trace(self, text_or_ids, tokenizer=None, top_k: int = 5):
        """Per-step energies, ranks and runner-up nodes of a text's path (`modeling_brillm.energy_trace`)."""
        return package_tool("interpretability", "energy_trace").energy_trace(self, text_or_ids, tokenizer=tokenizer,
                                                                             top_k=top_k)


def checkpointed(checkpoint, fn, structs, link):
    """`fn(*structs, link)` through the checkpoint function `checkpoint`, every tensor of the dataclasses `structs`
    passed to it as an argument of its own (a reentrant checkpoint tracks the gradients of those only)."""
    names = [[f.name for f in dataclasses.fields(s)] for s in structs]
    flat = [getattr(s, n) for s, ns in zip(structs, names) for n in ns]

    def run(*values):
        it = iter(values)
        rebuilt = [dataclasses.replace(s, **{n: next(it) for n in ns}) for s, ns in zip(structs, names)]
        signals, mix = fn(*rebuilt, link)
        return (signals, *mix.tensors())

    signals, *mix = checkpoint(run, *flat)
    return signals, Mix(*mix)
