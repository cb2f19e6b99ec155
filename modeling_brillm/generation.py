"""BriLLM in transformers' generation loop: `generate()`, pipelines, beam search, and the one-token decode step.

BriLLM carries an O(d) recurrent state (`BriLLMState`) where a Transformer carries key/value caches, so a few
hooks of transformers' `GenerationMixin` are adapted: the state is fed only the new columns, beams reorder it, and
the length checks count real tokens against the position limit (or none, for `position_overflow="extend"`).

One-token steps on a state (generate(), energy_generate, pipelines, or a direct call) take one of three paths,
chosen by `model.decode_mode`:
    "auto"   on CUDA the sync-free step (`BriLLMModel.decode_step`: fixed shapes, no reads of the device), captured
             into a CUDA graph per batch size when a decoding loop calls it (`generation_step=True`); one row on
             the CPU the host step (`host_step`: the general path's math with its lookups done on the host);
             elsewhere the general path
    "eager"  the sync-free step without capture, on any device (what CPU tests compare against "off")
    "off"    the general path (`BriLLMModel.run_signals` + successor logits), which reads the device for its checks
"""

from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F
from transformers import EosTokenCriteria, GenerationMixin, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.utils import ModelOutput, logging

from .decode_capture import DecodeGraphs
from .decoding import _finish_check_every
from .energy import block_outputs
from .graph import edge_row
from .ops import kernel_enabled
from .recurrence import plus_edge_base
from .state import CACHE, BriLLMState, HostState, given_state
from .validation import check_inputs, too_long

logger = logging.get_logger(__name__)
# the field of generate()'s output that holds the final state ("cache" in recent transformers)
GENERATE_CACHE = CACHE if CACHE in GenerateDecoderOnlyOutput.__dataclass_fields__ else "past_key_values"


def _called_in_turn(processors: LogitsProcessorList):
    """The processors as one call. transformers' list reads every processor's signature at each token (~50 µs a
    processor on a CPU, as much as a step); where each takes just (input_ids, scores), they are called in turn."""
    if any(len(inspect.signature(processor.__call__).parameters) > 2 for processor in processors):
        return processors  # one that asks for more: the list's own call says what is missing

    def process(input_ids, scores):
        for processor in processors:
            scores = processor(input_ids, scores)
        return scores
    return process


def _host_eos_ids(criteria: StoppingCriteriaList) -> frozenset[int]:
    """The ids that end a row under `criteria`' EOS criteria (transformers' `EosTokenCriteria`), as host integers."""
    return frozenset(i for c in criteria if isinstance(c, EosTokenCriteria) for i in c.eos_token_id.view(-1).tolist())


class HostStep:
    """One token of one row on the CPU: the one-token step's math (`edge_update`, `block_logits`, `read_out`) for a
    single row, with the few integers it needs (the token, its position, the edge it crosses, its successors' block)
    and the running mix's two scalars on the host, where a read is free. Every table is read as a slice, no op runs
    over the whole graph to look one row up, and oneDNN is off while it runs: its GeLU costs ~10 µs a call however
    small the tensor, torch's own 1.5 µs.

    A step scores every successor v of the token u it lands on with the output GeLU(s·W[u→v] + b + PE) of the edge
    u→v; the next step crosses one of these very edges with the same signal s at the same position, so it mixes in
    the output already computed (`BriLLMState.next_edges`) instead of computing it again. It equals the general path
    within float32 rounding (the mix's weights are computed in double precision, an edge's output by the block's
    `baddbmm`).

    A decoding loop's first step builds it and the states it returns carry it (`BriLLMState.step`), so what does
    not change between tokens (the config's numbers, the tables, the graph on the host) is read once per loop."""

    def __init__(self, model):
        base, cfg = model.base_model, model.config
        self.base, self.V, self.M = base, cfg.vocab_size, cfg.max_position_embeddings
        self.extends, self.dense = base.extends_positions, cfg.graph == "dense"
        self.csr = None if self.dense else base.host_csr()
        self.indices = None if self.dense else base.graph_indices
        self.weights, self.biases = base.weights.detach(), base.biases.detach()
        self.dtype = self.weights.dtype  # the edges' (float32 unless the model was cast)
        self.table = base.position_table(self.weights.device).to(self.dtype)
        self.position_logits = base.positions.detach().view(-1).tolist()
        self.edge_base, self.non_edge_bias = base.edge_base, base.non_edge_bias
        self.node_vectors, self.readout = base.node_embedding, base.node_readout
        self.prior = base.prior_table() if cfg.count_prior else None
        self.sparse_prior = cfg.count_prior and self.prior is None

    def __call__(self, tokens: torch.Tensor, token: int, state: BriLLMState):
        """`tokens` (1,) the new token (`token` its id on the host) on top of `state`: (logits (1, V), new state)."""
        if state.step is self:  # this step's own state: its scalars are on the host
            length, source, norm, top = state.host
        else:
            length, source = int(state.length), int(state.last_token)
            norm, top = float(state.mix_norm), float(state.mix_max)
        if length >= self.M and not self.extends:
            raise too_long(length + 1, self.M)
        onednn, torch.backends.mkldnn.enabled = torch.backends.mkldnn.enabled, False  # see the class docstring
        try:
            out = self._edge_output(source, token, length, state)
            signal, mix_sum, norm, top = self._mix(out, token, length, state.mix_sum, norm, top)
            logits, next_edges = self._logits(signal, token, self._pe(length + 1))
        finally:
            torch.backends.mkldnn.enabled = onednn
        return logits, HostState(signal, mix_sum, tokens, (length + 1, token, norm, top), state.seen + 1, self,
                                 next_edges)

    def _pe(self, position: int) -> torch.Tensor:
        """The PE row (1, d) of `position`: from the table within range, else its formula."""
        if position <= self.M:
            return self.table[position:position + 1]
        return self.base.position_encoding(torch.tensor([position])).to(self.dtype)

    def _block(self, source: int) -> tuple[int, int]:
        """Entries first..last−1 of the successors of `source` (edge rows first+1..last)."""
        return (source * self.V, source * self.V + self.V) if self.dense else self.csr[0][source:source + 2]

    def _edge_output(self, source: int, token: int, length: int, state: BriLLMState) -> torch.Tensor:
        """The output GeLU(x·W + b + PE) of the edge source→token (its row 0, the shared edge, for a pair without
        one): the previous step's ((d,) a successor's row, (1, d) the shared edge's), or computed as `edge_update`
        does ((1, d)); the mix broadcasts either."""
        row = edge_row(self.csr, source, token, self.V)
        if state.next_edges is not None and state.step is self:
            successors, shared = state.next_edges
            return shared if row == 0 else successors[row - 1 - self._block(source)[0]]
        W, x = self.weights, state.signal.to(self.dtype)
        return F.gelu(torch.addmm(self.biases[row] + plus_edge_base(self._pe(length), x, self.edge_base), x, W[row]))

    def _mix(self, out: torch.Tensor, token: int, length: int, mix_sum: torch.Tensor, norm: float, top: float):
        """The edge output (plus the entered node's vector) mixed into the state as `mix_in` does, its norm and
        maximum on the host: (signal, mix_sum, mix_norm, mix_max)."""
        out = out.float()
        if self.node_vectors is not None:
            out = out + self.node_vectors[token].float()
        weight_logit = self.position_logits[min(max(length - 1, 0), self.M - 1)]
        new_top = max(top, weight_logit)
        decay, weight = math.exp(top - new_top), math.exp(weight_logit - new_top)
        if decay != 1.0:  # the maximum moved (always at the first edge, rarely after)
            mix_sum = mix_sum * decay
        mix_sum = torch.add(mix_sum, out, alpha=weight)
        norm = norm * decay + weight
        return mix_sum / norm, mix_sum, norm, new_top

    def _logits(self, signal: torch.Tensor, token: int, pe: torch.Tensor):
        """(1, V) energies of every node as `token`'s successor plus what `read_out` adds, and the outputs of the
        edges leaving `token`: (successors' (n, d), the shared edge's (1, d) or None)."""
        x = signal.to(self.dtype)
        first, last = self._block(token)
        logits, successors, shared = block_outputs(x, plus_edge_base(pe, x, self.edge_base), self.weights,
                                                   self.biases, first, last, self.indices, self.V, self.non_edge_bias)
        logits = logits.float()
        if self.sparse_prior:  # a vocabulary too large for the prior's dense table: the general read-out
            return self.base.read_out(logits, signal, torch.tensor([token])), (successors, shared)
        if self.readout is not None:
            r = self.readout
            logits = torch.addmm(logits, signal, r.t()) if r.dtype == torch.float32 else \
                logits + (signal.to(r.dtype) @ r.t()).float()
        if self.prior is not None:
            logits = logits + self.prior[token]
        return logits, (successors, shared)


class BriLLMGenerationMixin(GenerationMixin):
    """transformers' `GenerationMixin` for a model that carries a `BriLLMState` instead of key/value caches."""

    decode_mode = "auto"
    # the sync-free step without Triton gathers (rows × max degree) edge matrices; above this many bytes the one-token
    # steps take the general path instead (a dense V = 4000 graph at batch 32 would gather 2 GB)
    padded_decode_bytes = 512 * 2**20

    # ------------------------------------------------------------------------------- the one-token step
    def sync_free_decoding(self, input_ids) -> bool:
        """Whether a one-token step on `input_ids` takes the sync-free step (see the module docstring)."""
        mode = self.decode_mode
        if mode not in ("auto", "eager", "off"):
            raise ValueError(f"decode_mode must be 'auto', 'eager' or 'off', got {mode!r}.")
        if mode == "off" or not (mode == "eager" or input_ids.is_cuda):
            return False
        base = self.base_model
        if not kernel_enabled("decode_step", input_ids):
            # the torch version gathers every row's padded block: keep its temporary within bounds
            d = self.config.node_size
            gathered = input_ids.shape[0] * base.decode_max_degree() * d * d * base.weights.element_size()
            return gathered <= self.padded_decode_bytes
        return True

    def generation_step(self, input_ids, attention_mask, state: BriLLMState, trusted: bool):
        """One token per row without reading the device: (logits (B, V), new state), or None to hand the call
        back to the general path (a padded new column). `trusted`: the ids are the decoding loop's own picks."""
        if not isinstance(state, BriLLMState):
            raise TypeError("the cache must be the BriLLMState a previous call returned (output.state), got "
                            f"{type(state).__name__}.")
        tokens = self._step_tokens(input_ids, attention_mask, state, trusted)
        if tokens is None:
            return None
        B, M = input_ids.shape[0], self.config.max_position_embeddings
        if state.longest is None:
            state.longest = int(state.length.max()) if B else 0  # once per generation; then tracked on the host
        if not self.extends_positions and state.longest >= M:
            raise too_long(state.longest + 1, M)
        replayed = None
        if trusted and self.decode_mode == "auto" and input_ids.is_cuda:
            replayed = self._replay_decode_graph(tokens, state)
        if replayed is not None:
            logits, new_tensors = replayed
        else:
            base = self.base_model
            logits, new_tensors = base.decode_step(tokens, state.tensors(), base.decode_max_degree())
        new_state = BriLLMState(*new_tensors, seen=state.seen + 1, longest=state.longest + 1)
        new_state.graph_owned = replayed is not None
        return logits, new_state

    def host_decoding(self, input_ids, signal_ids) -> bool:
        """Whether a one-token step takes the host step: one row on the CPU under decode_mode "auto"."""
        return (self.decode_mode == "auto" and input_ids.shape[0] == 1 and input_ids.device.type == "cpu"
                and signal_ids is None)

    def host_step(self, input_ids, attention_mask, state: BriLLMState, trusted: bool):
        """One token of one row on the CPU (a direct call): (logits (1, V), new state), or None for a padding column.
        `trusted`: the id is a decoding loop's own pick (a finished row's pad id is clamped, not checked)."""
        if not isinstance(state, BriLLMState):
            raise TypeError("the cache must be the BriLLMState a previous call returned (output.state), got "
                            f"{type(state).__name__}.")
        step = state.step if state.step is not None and state.step.base is self.base_model else HostStep(self)
        if trusted:
            given = int(input_ids)
            token = min(max(given, 0), step.V - 1)
            tokens = input_ids[0] if token == given else input_ids.new_tensor([token])
        else:
            tokens = self._step_tokens(input_ids, attention_mask, state, trusted)
            if tokens is None:
                return None
            token = int(tokens)
        return step(tokens, token, state)

    def _step_tokens(self, input_ids, attention_mask, state, trusted: bool):
        """The (B,) ids of a one-token step, or None when its column holds padding (the general path's case)."""
        B = input_ids.shape[0]
        if trusted:
            if state.batch_size != B:
                raise ValueError(f"the cache holds {state.batch_size} sequences but input_ids has {B} rows.")
            # Only a finished row can be fed an id the model did not pick (the pad token, which may lie outside the
            # vocabulary); its state and logits are never used again, so clamping keeps every index in range.
            return input_ids[:, 0].clamp(0, self.config.vocab_size - 1)
        mask = check_inputs(input_ids, attention_mask, state, self.config.vocab_size)
        return input_ids[:, 0] if bool(mask.all()) else None

    def _replay_decode_graph(self, tokens, state):
        """The step from its CUDA graph (decode_capture.py): (logits, new state tensors); None where capturing fails,
        said once: this model then decodes with the same step uncaptured (decode_mode becomes "eager")."""
        if getattr(self, "_decode_graphs", None) is None:
            self._decode_graphs = DecodeGraphs()
        try:
            return self._decode_graphs.step(self.base_model, tokens, state)
        except RuntimeError as error:  # the capture never ran on this GPU / driver / triton before: keep decoding
            self._decode_graphs.clear()
            self.decode_mode = "eager"
            first_line = str(error).splitlines()[0] if str(error) else ""
            logger.warning(f"BriLLM: capturing the decode step into a CUDA graph failed ({type(error).__name__}: "
                           f"{first_line}); decoding continues with the same step uncaptured (model.decode_mode = "
                           "'eager', a few times slower per token at batch 1). Please report it with your GPU, torch "
                           "and triton versions.")
            return None

    # ------------------------------------------------------------------------- transformers' hooks
    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # BriLLM carries its own O(d) state (`BriLLMState`), not attention key/value caches

    def prepare_inputs_for_generation(self, input_ids, cache=None, attention_mask=None, use_cache=None,
                                      logits_to_keep=None, past_key_values=None, **kwargs):
        state = given_state(cache, past_key_values)
        if state is not None:
            # the state has consumed `seen` columns: feed only the new ones
            input_ids = input_ids[:, state.seen:]
        inputs = {
            "input_ids": input_ids.contiguous(),
            "attention_mask": attention_mask,
            CACHE: state,
            "use_cache": True if use_cache is None else use_cache,
            "logits_to_keep": 1 if logits_to_keep is None else logits_to_keep,
            # generate() appends a column of ones to the mask and feeds its own picks: the step may skip its checks
            "generation_step": state is not None,
        }
        if state is None and kwargs.get("signal_ids") is not None:
            inputs["signal_ids"] = kwargs["signal_ids"]  # the first call starts the signal; later ones carry state
        return inputs

    def generate(self, *args, **kwargs):
        # Every tensor argument (ids, attention mask, signal_ids, ...) goes where the model is, as in forward():
        # generate() concatenates the new tokens (made on the model's device) to the prompt, so it must live there.
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
        """transformers' greedy / sampling loop, written around BriLLM's own one-token steps where one applies (one
        row on the CPU: the host step; on CUDA: the sync-free step, replayed from its CUDA graph): the same
        processors, stopping criteria, random draws, streamer calls and outputs, without the per-token model call,
        output object and mask update that cost as much as a step. On a GPU "has every row finished?" is read every
        few steps (the steps past the end, all padding, are then dropped), unless a streamer or the returned state
        needs every step as it comes."""
        step = self._loop_step(input_ids, generation_config, kwargs)
        if step is None:
            return super()._sample(input_ids, logits_processor, stopping_criteria, generation_config, **kwargs)
        logits_processor = _called_in_turn(logits_processor)
        # the loop stops at max_length on the host; transformers' length criterion would build two tensors a token
        finishing = StoppingCriteriaList([c for c in stopping_criteria if not isinstance(c, MaxLengthCriteria)])
        batch = input_ids.shape[0]
        # one row on the CPU: its pick is compared with the EOS ids on the host, where the criterion's isin, any and
        # the loop's flags would cost ~40 µs a token, as much as the model's step past its block
        eos_ids = _host_eos_ids(finishing) if batch == 1 and input_ids.device.type == "cpu" else None
        if eos_ids is not None:
            finishing = StoppingCriteriaList([c for c in finishing if not isinstance(c, EosTokenCriteria)])
        streamer, config = kwargs.pop("streamer", None), generation_config
        kwargs.pop("synced_gpus", None)
        keep_scores, keep_logits = (config.return_dict_in_generate and config.output_scores,
                                    config.return_dict_in_generate and config.output_logits)
        scores, raw_logits = (() if keep_scores else None), (() if keep_logits else None)
        pad = config._pad_token_tensor
        # one row stops where it finishes; rows that finish early are fed the pad token, as in transformers' loop
        fill = batch > 1 and any(hasattr(criterion, "eos_token_id") for criterion in stopping_criteria)
        every = 1 if streamer is not None or config.return_dict_in_generate else _finish_check_every(input_ids.device)
        out = self(**self.prepare_inputs_for_generation(input_ids, **kwargs), return_dict=True)
        state, logits = out[CACHE], out.logits[:, -1].to(copy=True, dtype=torch.float32)
        unfinished = torch.ones(batch, dtype=torch.long, device=input_ids.device)
        alive = []  # per step since the last read: did any row still generate after it (device flags)
        while True:
            next_scores = logits_processor(input_ids, logits)
            scores = scores + (next_scores,) if keep_scores else None
            raw_logits = raw_logits + (logits,) if keep_logits else None
            if config.do_sample:
                token = torch.multinomial(F.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
            else:
                token = torch.argmax(next_scores, dim=-1)
            if fill:
                token = token * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, token[:, None]], dim=-1)
            if streamer is not None:
                streamer.put(token.cpu())
            at_length = input_ids.shape[1] >= config.max_length  # no step past the length asked
            if eos_ids is not None:  # one row on the CPU: it ends at its own pick, no flags to keep
                if at_length or int(token) in eos_ids or (finishing and bool(finishing(input_ids, scores))):
                    break
            else:
                if finishing:  # else only the length ends the loop
                    unfinished = unfinished & ~finishing(input_ids, scores)
                    alive.append(unfinished.any())
                if at_length or len(alive) == every:
                    flags = torch.stack(alive).tolist() if alive else [True]
                    if at_length or not flags[-1]:
                        undo = len(flags) - 1 - flags.index(False) if False in flags else 0  # steps after the end
                        input_ids = input_ids[:, :input_ids.shape[1] - undo]
                        scores = scores[:len(scores) - undo] if keep_scores else None
                        raw_logits = raw_logits[:len(raw_logits) - undo] if keep_logits else None
                        break
                    alive = []
            logits, state = step(token, state)
        if streamer is not None:
            streamer.end()
        if not config.return_dict_in_generate:
            return input_ids
        return GenerateDecoderOnlyOutput(sequences=input_ids, scores=scores, logits=raw_logits, attentions=None,
                                         hidden_states=None, **{GENERATE_CACHE: state})

    def _loop_step(self, input_ids, generation_config, kwargs):
        """The one-token step `_sample`'s own loop runs, `step(tokens (B,), state) -> (float32 logits (B, V), state)`,
        or None where transformers' loop runs: hidden states or attentions asked for, syncing processes, an
        assistant's rounds, a given cache or none wanted (`use_cache=False`), or no own step for this batch and
        device."""
        config = generation_config
        if (kwargs.get("synced_gpus") or config.output_hidden_states or config.output_attentions
                or getattr(config, "is_assistant", False) or kwargs.get(CACHE) is not None
                or kwargs.get("use_cache") is False):
            return None
        if self.sync_free_decoding(input_ids):
            def sync_free(tokens, state):
                logits, state = self.generation_step(tokens[:, None], None, state, True)
                return logits.to(copy=True, dtype=torch.float32), state  # a replayed graph's buffer: copy it out
            return sync_free
        if self.host_decoding(input_ids, None):
            host = HostStep(self)
            return lambda tokens, state: host(tokens, int(tokens), state)
        return None

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

    def _reorder_cache(self, cache: BriLLMState, beam_idx: torch.LongTensor) -> BriLLMState:
        return cache.reorder_cache(beam_idx)


__all__ = ["BriLLMGenerationMixin"]
