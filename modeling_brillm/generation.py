"""BriLLM in transformers' generation loop: `generate()`, pipelines, beam search, and the one-token step.

`decode_loop` (greedy decoding and sampling, shared by `generate()` and `energy_generate`) runs the general path or
the one-token step, which on a GPU `DecodeGraphs` records into a CUDA graph per batch size (docs/gpu.md)."""

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import EosTokenCriteria, GenerationMixin, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput, logging

from .backend import current_backend
from .ops import kernel_enabled
from .state import CACHE, BriLLMState, given_state
from .validation import check_inputs, too_long

logger = logging.get_logger(__name__)
# the field of generate()'s output that holds the final state ("cache" in recent transformers)
GENERATE_CACHE = CACHE if CACHE in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"
DECODE_MODES = ("auto", "eager", "off")


def finish_check_every(device: torch.device) -> int:
    """Steps between two reads of "has every row finished?": 8 on a GPU (a read waits for the queued work), else 1."""
    return 8 if device.type == "cuda" else 1


def called_in_turn(processors):
    """The processors as one call. transformers' list reads every processor's signature at each token (~50 µs a
    processor on a CPU, as much as a step); where each takes just (input_ids, scores), they are called in turn."""
    if any(len(inspect.signature(processor.__call__).parameters) > 2 for processor in processors):
        return processors  # one that asks for more: the list's own call says what is missing

    def process(input_ids, scores):
        for processor in processors:
            scores = processor(input_ids, scores)
        return scores
    return process


@dataclass
class Decoding:
    """What one run of `decode_loop` decodes with."""

    processors: object  # (input_ids, logits) -> scores: temperature, penalties, bans, ...
    criteria: StoppingCriteriaList  # what ends a row, the length apart
    max_length: int  # the loop ends when the sequences are this long
    do_sample: bool = False
    pad: torch.Tensor | None = None  # fed to the rows that finished (None: rows are not filled)
    generator: torch.Generator | None = None
    streamer: object | None = None
    record: object | None = None  # called (logits, scores, tokens, unfinished before the step) every step
    check_every: int = 1  # steps between two reads of "has every row finished?" (the steps past it are dropped)

    def __post_init__(self):
        self.eos_ids = None  # one row on the CPU checks its pick here, on the host: the criteria cost as much as a step
        self.criteria = StoppingCriteriaList([c for c in self.criteria if not isinstance(c, MaxLengthCriteria)])

    def one_row_on_the_host(self, input_ids):
        if input_ids.shape[0] == 1 and input_ids.device.type == "cpu":
            eos = [c for c in self.criteria if isinstance(c, EosTokenCriteria)]
            self.eos_ids = frozenset(i for c in eos for i in c.eos_token_id.view(-1).tolist())
            self.criteria = StoppingCriteriaList([c for c in self.criteria if not isinstance(c, EosTokenCriteria)])


def decode_loop(input_ids, logits, state, step, run: Decoding):
    """Greedy decoding or sampling from `logits` (B, V) float32 after `input_ids` (B, T), `step(tokens, state)` the next
    token's: (sequences, final state, steps kept), dropping the steps run after every row had finished."""
    run.one_row_on_the_host(input_ids)
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    alive, steps = [], 0  # per step since the last read: did any row still generate after it (device flags)
    while True:
        scores = run.processors(input_ids, logits)
        if run.do_sample:
            token = torch.multinomial(F.softmax(scores, dim=-1), num_samples=1, generator=run.generator).squeeze(1)
        else:
            token = torch.argmax(scores, dim=-1)
        if run.pad is not None:
            token = torch.where(unfinished, token, run.pad)
        if run.record is not None:
            run.record(logits, scores, token, unfinished)
        input_ids, steps = torch.cat([input_ids, token[:, None]], dim=-1), steps + 1
        if run.streamer is not None:
            run.streamer.put(token.cpu())
        at_length = input_ids.shape[1] >= run.max_length  # no step past the length asked
        if run.eos_ids is not None:  # one row on the CPU: it ends at its own pick, no flags to keep
            if at_length or int(token) in run.eos_ids or (run.criteria and bool(run.criteria(input_ids, scores))):
                return input_ids, state, steps
        else:
            if run.criteria:  # else only the length ends the loop
                unfinished = unfinished & ~run.criteria(input_ids, scores)
                alive.append(unfinished.any())
            if at_length or len(alive) == run.check_every:
                flags = torch.stack(alive).tolist() if alive else [True]
                if at_length or not flags[-1]:
                    undo = len(flags) - 1 - flags.index(False) if False in flags else 0  # steps after the end
                    return input_ids[:, :input_ids.shape[1] - undo], state, steps - undo
                alive = []
        logits, state = step(token, state)


def _signature(model, device) -> tuple:
    """Everything a captured step depends on by address or by value (`model` is a `BriLLMModel`); the lazily built
    tables (positions, prior) are built here, before their addresses are read."""
    cfg = model.config
    graph = (model.graph_indptr, model.graph_indices, model.edge_keys()) if cfg.graph == "sparse" else ()
    prior = (model.prior_node, model.prior_indptr, model.prior_indices, model.prior_values, model.prior_table()) \
        if cfg.count_prior else ()  # the step adds the prior's row of every token
    # the extensions the step reads: the non-successors' offsets, edge_base, the nodes' vectors and readout
    tensors = (model.weights, model.biases, model.positions, model.position_table(device), *graph,
               model.non_edge_bias, model.edge_base, model.node_embedding, model.node_readout, *prior)
    return (tuple(t.data_ptr() for t in tensors if t is not None), model.weights.dtype, str(device), current_backend(),
            cfg.vocab_size, cfg.max_position_embeddings, cfg.position_overflow, cfg.position_encoding,
            model.graph_view().max_degree)


class _Graph:
    def __init__(self, model, tokens, state, signature, pool):
        self.signature = signature
        device = tokens.device
        width = model.graph_view().max_degree
        self.tokens = tokens.detach().clone()
        self.state = state.clone()
        # warm up on a side stream (Triton compiles its kernels, caches fill), then record
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                model.decode_step(self.tokens, self.state, width)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits, new_state = model.decode_step(self.tokens, self.state, width)
            for buffer, value in zip(self.state.tensors(), new_state.tensors()):
                buffer.copy_(value)  # the state advances in place: its next step reads it where it is

    def step(self, tokens, state):
        self.tokens.copy_(tokens)
        for t, buffer in zip(state.tensors(), self.state.tensors()):
            if t is not buffer:  # a state this graph did not advance: copy it in
                buffer.copy_(t)
        self.graph.replay()
        longest = None if state.longest is None else state.longest + 1
        return self.logits, BriLLMState.of(self.state.tensors(), state.seen + 1, longest)


class DecodeGraphs:
    """The captured decode steps of one model, one per batch size (they share one memory pool)."""

    def __init__(self):
        self.graphs: dict[int, _Graph] = {}
        self.clear()

    def step(self, model, tokens: torch.Tensor, state, tables):
        """Logits (B, V) and the new state (in the graph's buffers) of `tokens` (B,) on `state`, `tables` the loop's."""
        if tables is not self.tables:
            self.tables, self.signature = tables, _signature(model, tokens.device)
        B = tokens.shape[0]
        graph = self.graphs.get(B)
        if graph is None or graph.signature != self.signature:
            if graph is not None or self.pool is None:  # tables moved: every graph of this model is stale
                self.graphs.clear()
                self.pool = torch.cuda.graph_pool_handle()
            graph = self.graphs[B] = _Graph(model, tokens, state, self.signature, self.pool)
        logits, new_state = graph.step(tokens, state)
        new_state.graph_owned = True
        return logits, new_state

    def clear(self):
        self.graphs.clear()
        self.pool = self.tables = self.signature = None  # tables: the decoding loop's, signature: read with them


class BriLLMGenerationMixin(GenerationMixin):
    """transformers' `GenerationMixin` for a model that carries a `BriLLMState` instead of key/value caches."""

    decode_mode = "auto"
    # without Triton a one-token step gathers rows × largest degree matrices: past this many bytes, the general path
    padded_decode_bytes = 512 * 2**20

    def steps_one_token(self, input_ids) -> bool:
        """Whether one new column `input_ids` (B, 1) takes the one-token step (docs/gpu.md, "Decoding")."""
        mode = self.decode_mode
        if mode not in DECODE_MODES:
            raise ValueError(f"decode_mode must be one of {DECODE_MODES}, got {mode!r}.")
        if not (isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.shape[1] == 1
                and self.base_model.edges.fused):  # an edge kind read through materialised rows: the general path
            return False
        cpu_row = input_ids.device.type == "cpu" and input_ids.shape[0] == 1
        if mode == "off" or (mode == "auto" and not (input_ids.is_cuda or cpu_row)):
            return False
        if kernel_enabled("successor_logits", input_ids) or cpu_row:  # one row reads its block in place
            return True
        base, d = self.base_model, self.config.node_size
        width = base.graph_view().max_degree
        return input_ids.shape[0] * width * d * d * base.weights.element_size() <= self.padded_decode_bytes

    def generation_step(self, input_ids, attention_mask, state: BriLLMState, trusted: bool, tables=None):
        """One token per row: (logits (B, V), new state), or None: the general path (`trusted`: the loop's ids)."""
        if not isinstance(state, BriLLMState):
            raise TypeError("the cache must be the BriLLMState a previous call returned (output.state), got "
                            f"{type(state).__name__}.")
        base = self.base_model
        tables = base.step_tables() if tables is None else tables
        tokens = self._step_tokens(input_ids, attention_mask, state, trusted, tables.graph.vocab_size)
        if tokens is None:
            return None
        M = tables.positions.trained
        if state.longest is None:
            state.longest = int(state.length.max()) if state.batch_size else 0  # once; then tracked on the host
        if tables.positions.formula is None and state.longest >= M:  # (a formula: position_overflow="extend")
            raise too_long(state.longest + 1, M)
        if trusted and input_ids.is_cuda and self.decode_mode == "auto":
            replayed = self._replay_decode_graph(tokens, state, tables)
            if replayed is not None:
                return replayed
        # on the CPU the host reads each row's degree (free there); elsewhere the shapes stay fixed
        width = None if input_ids.device.type == "cpu" else tables.graph.max_degree
        return base.decode_step(tokens, state, width, tables)

    def _step_tokens(self, input_ids, attention_mask, state, trusted: bool, vocab_size: int):
        """The (B,) ids of a one-token step, or None when its column holds padding (the general path's case)."""
        B = input_ids.shape[0]
        if trusted:
            if state.batch_size != B:
                raise ValueError(f"the cache holds {state.batch_size} sequences but input_ids has {B} rows.")
            if state.row is not None:  # one row on the CPU, never filled with the pad token: its own picks
                return input_ids[0]
            # only a finished row gets an id it did not pick (the pad token, maybe out of range): clamped, never used
            return input_ids[:, 0].clamp(0, vocab_size - 1)
        mask = check_inputs(input_ids, attention_mask, state, vocab_size)
        return input_ids[:, 0] if bool(mask.all()) else None

    def _replay_decode_graph(self, tokens, state, tables):
        """The step from its CUDA graph: (logits, new state), or None where capture fails (decode_mode -> "eager")."""
        if getattr(self, "_decode_graphs", None) is None:
            self._decode_graphs = DecodeGraphs()
        try:
            return self._decode_graphs.step(self.base_model, tokens, state, tables)
        except RuntimeError as error:  # the capture never ran on this GPU / driver / triton before: keep decoding
            self._decode_graphs.clear()
            self.decode_mode = "eager"
            first_line = str(error).splitlines()[0] if str(error) else ""
            logger.warning(f"BriLLM: capturing the decode step into a CUDA graph failed ({type(error).__name__}: "
                           f"{first_line}); decoding goes on uncaptured (model.decode_mode = 'eager', slower per "
                           "token). Please report it with your GPU, torch and triton versions.")
            return None

    def loop_step(self, input_ids):
        """The decoding loop's `step(tokens, state) -> (float32 logits, state)`: the one-token step, else `forward`."""
        if self.steps_one_token(input_ids[:, -1:]):
            tables = self.base_model.step_tables()

            def one_token(tokens, state):
                logits, state = self.generation_step(tokens[:, None], None, state, True, tables)
                # a replayed graph's logits are its buffer, which the next replay overwrites: copy them out
                return (logits.clone() if state.graph_owned else logits), state
            return one_token

        def general(tokens, state):
            out = self(tokens[:, None], cache=state, use_cache=True, logits_to_keep=1, generation_step=True)
            return out.logits[:, -1].float(), out.state
        return general

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # BriLLM carries its own O(d) state (`BriLLMState`), not attention key/value caches

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, use_cache=None,
                                      logits_to_keep=None, past_key_values=None, **kwargs):
        state = given_state(cache, past_key_values)
        if state is not None:  # the state has consumed `seen` columns: feed only the new ones
            input_ids = input_ids[:, state.seen:]
        # generate() appends a column of ones to the mask and feeds its own picks: the step may skip its checks
        inputs = {"input_ids": input_ids.contiguous(), "attention_mask": attention_mask, CACHE: state,
                  "use_cache": True if use_cache is None else use_cache, "generation_step": state is not None,
                  "logits_to_keep": 1 if logits_to_keep is None else logits_to_keep}
        if state is None and kwargs.get("signal_ids") is not None:
            inputs["signal_ids"] = kwargs["signal_ids"]  # the first call starts the signal; later ones carry state
        return inputs

    def generate(self, *args, **kwargs):
        # every tensor argument goes to the model's device (as in forward()), where generate() appends the new tokens
        args = self.to_input_device(*args)
        kwargs = dict(zip(kwargs, self.to_input_device(*kwargs.values())))
        # remember the prompt's real lengths: padding takes no position, so the length check counts real tokens
        mask = kwargs.get("attention_mask")
        self._prompt_mask = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        try:
            out = super().generate(*args, **kwargs)
        finally:
            self._prompt_mask = None
        state = out.get(CACHE) if isinstance(out, ModelOutput) else None
        if getattr(state, "graph_owned", False):  # a captured step's buffers: the next generate() overwrites them
            out[CACHE] = state.clone()
        return out

    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, **kwargs):
        """transformers' greedy / sampling loop as `decode_loop` on the one-token step (the rest: transformers')."""
        config = generation_config
        if (kwargs.get("synced_gpus") or config.output_hidden_states or config.output_attentions
                or getattr(config, "is_assistant", False) or kwargs.get(CACHE) is not None
                or kwargs.get("use_cache") is False):
            return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)
        streamer = kwargs.pop("streamer", None)
        kwargs.pop("synced_gpus", None)
        keep_scores = config.return_dict_in_generate and config.output_scores
        keep_logits = config.return_dict_in_generate and config.output_logits
        kept = ([], [])

        def record(logits, scores, tokens, unfinished):
            if keep_scores:
                kept[0].append(scores)
            if keep_logits:
                kept[1].append(logits)

        # rows that finish early are fed the pad token, as in transformers' loop (with an EOS criterion)
        fill = input_ids.shape[0] > 1 and any(hasattr(c, "eos_token_id") for c in stopping_criteria)
        every = 1 if streamer is not None or config.return_dict_in_generate else finish_check_every(input_ids.device)
        run = Decoding(called_in_turn(logits_processor), stopping_criteria, config.max_length, config.do_sample,
                       config._pad_token_tensor if fill else None, streamer=streamer,
                       record=record if keep_scores or keep_logits else None, check_every=every)
        out = self(**self.prepare_inputs_for_generation(input_ids, **kwargs), return_dict=True)
        logits = out.logits[:, -1].to(copy=True, dtype=torch.float32)
        sequences, state, steps = decode_loop(input_ids, logits, out[CACHE], self.loop_step(input_ids), run)
        if streamer is not None:
            streamer.end()
        if not config.return_dict_in_generate:
            return sequences
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=tuple(kept[0][:steps]) if keep_scores else None,
                                         logits=tuple(kept[1][:steps]) if keep_logits else None, attentions=None,
                                         hidden_states=None, **{GENERATE_CACHE: state})

    def _prepare_generated_length(self, generation_config, has_default_max_length, has_default_min_length,
                                  model_input_name, input_ids_length, inputs_tensor):
        default_max_length = generation_config.max_length
        generation_config = super()._prepare_generated_length(generation_config, has_default_max_length,
                                                              has_default_min_length, model_input_name,
                                                              input_ids_length, inputs_tensor)
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
            raise ValueError(f"the prompt holds {longest} tokens, more than max_position_embeddings={M} of this model; "
                             f"shorten it to at most {M - 1} tokens to leave room for new ones, or set "
                             "config.position_overflow=\"extend\".")
        if longest + new_tokens > M:
            raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={new_tokens} exceeds "
                             f"max_position_embeddings={M} of this model: at most {M - longest} new tokens fit. "
                             "Lower max_new_tokens, or set config.position_overflow=\"extend\".")

    def _reorder_cache(self, cache: BriLLMState, beam_idx: torch.LongTensor) -> BriLLMState:
        return cache.reorder_cache(beam_idx)
