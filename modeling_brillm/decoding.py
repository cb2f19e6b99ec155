"""BriLLM's own decoding, `energy_generate`: the next node is the one whose incoming edge receives the most energy,
with the *energy path* recorded: for every step and row, the node the signal sat on, the node chosen, its energy
(raw logit), its rank among all V nodes, its probability, and the strongest runner-ups.

It runs in the decoding loop `generate()` runs (`generation.decode_loop`), with transformers' logits processors and
stopping criteria plus one of ours, `SelfLoopBan` (the release never moves from a node to itself); beam search is
`generate()`'s own, the paths read back from its logits and beam indices. A tool of the package: `model.
energy_generate` reaches it, and `save_custom_generate` writes it as a standalone transformers `custom_generate`
repository (on purpose not into model repositories, where transformers would replace `model.generate` itself).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
from transformers import (
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    MaxLengthCriteria,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .generation import Decoding, decode_loop, finish_check_every

__all__ = ["EnergyGenerateOutput", "EnergyStep", "SelfLoopBan", "energy_generate", "save_custom_generate"]


@dataclass
class EnergyStep:
    """One decoding step of one row: the signal sits on `source` and moves to `token`."""

    step: int  # 0-based index of the new token
    position: int  # position of the new token in its row's sequence (real tokens only, 0 = first token)
    source: int  # node the signal was on (the previous token)
    token: int  # chosen node
    energy: float  # energy delivered to `token` by the edge source→token (its raw logit)
    rank: int  # 1 + number of nodes that received strictly more energy (1 = the strongest of all V nodes)
    probability: float  # probability of `token` under the decoding distribution (after penalties/warpers)
    alternatives: list[tuple[int, float]]  # strongest other nodes: (node, energy), strongest first
    source_text: str | None = None
    token_text: str | None = None
    alternative_texts: list[str] | None = None

    def to_record(self) -> dict:
        record = {
            "step": self.step, "position": self.position, "source": self.source, "token": self.token,
            "energy": self.energy, "rank": self.rank, "probability": self.probability,
            "alternatives": [{"token": t, "energy": e} for t, e in self.alternatives],
        }
        if self.token_text is not None:
            record["source_text"], record["token_text"] = self.source_text, self.token_text
            for alt, text in zip(record["alternatives"], self.alternative_texts or []):
                alt["text"] = text
        return record


@dataclass
class EnergyGenerateOutput:
    """Result of `energy_generate`. All per-step tensors have shape (batch, steps[, num_alternatives]).

    `sequences` is the (left-aligned) prompt followed by the new tokens, like `generate()`'s output; rows that
    finished early are filled with the pad token and have `step_mask` False (energy NaN, rank 0) for those steps.
    """

    sequences: torch.LongTensor  # (B, T + steps)
    prompt_length: int  # T: columns of the prompt part of `sequences`
    sources: torch.LongTensor  # (B, steps) node the signal was on
    tokens: torch.LongTensor  # (B, steps) chosen nodes
    energies: torch.FloatTensor  # (B, steps) energy of the chosen node
    ranks: torch.LongTensor  # (B, steps) rank of the chosen node among all V nodes (1 = strongest)
    probabilities: torch.FloatTensor  # (B, steps) probability of the chosen node when it was drawn
    alternative_tokens: torch.LongTensor  # (B, steps, k) strongest other nodes, strongest first
    alternative_energies: torch.FloatTensor  # (B, steps, k)
    step_mask: torch.BoolTensor  # (B, steps) True where the row was still generating
    positions: torch.LongTensor  # (B, steps) position of each new token in its row (real tokens)
    attention_mask: torch.LongTensor | None = None  # (B, T + steps) 1 for real tokens (prompt padding is 0)
    tokenizer: object | None = field(default=None, repr=False)
    # beam search only: (B · num_return_sequences,) Σ log p(token) / new_tokens ** length_penalty of each sequence
    sequences_scores: torch.FloatTensor | None = None

    @property
    def num_steps(self) -> int:
        return self.tokens.shape[1]

    def path(self, row: int = 0, tokenizer=None) -> list[EnergyStep]:
        """The energy path of one row as a list of `EnergyStep` (real steps only)."""
        tokenizer = tokenizer if tokenizer is not None else self.tokenizer
        steps = []
        for s in range(self.num_steps):
            if not bool(self.step_mask[row, s]):
                break
            alt_t = self.alternative_tokens[row, s].tolist()
            alt_e = self.alternative_energies[row, s].tolist()
            step = EnergyStep(
                step=s, position=int(self.positions[row, s]), source=int(self.sources[row, s]),
                token=int(self.tokens[row, s]), energy=float(self.energies[row, s]), rank=int(self.ranks[row, s]),
                probability=float(self.probabilities[row, s]), alternatives=list(zip(alt_t, alt_e)),
            )
            if tokenizer is not None:
                step.source_text = _token_text(tokenizer, step.source)
                step.token_text = _token_text(tokenizer, step.token)
                step.alternative_texts = [_token_text(tokenizer, t) for t in alt_t]
            steps.append(step)
        return steps

    def to_records(self, tokenizer=None) -> list[list[dict]]:
        """JSON-ready: for every row, the list of its steps as dicts."""
        return [[s.to_record() for s in self.path(r, tokenizer)] for r in range(self.sequences.shape[0])]


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([int(token_id)], skip_special_tokens=False, clean_up_tokenization_spaces=False)


class SelfLoopBan(LogitsProcessor):
    """Forbids the move u→u: the node the signal sits on (each row's last token) may not follow itself."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores.scatter(1, input_ids[:, -1:], float("-inf"))


def _empty_prompt_message(config) -> str:
    bos = getattr(config, "bos_token_id", None)
    hint = f" (this model's BOS id is {bos}: input_ids=[[{bos}]])" if bos is not None else ""
    return ("empty prompt: BriLLM needs at least one token per row to start the signal from; start an "
            f"unconditional sample from the BOS token{hint}.")


def _prompt(model, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt as (batch, length) ids and a boolean mask on the model's input device, every row's real tokens
    moved to the right end (left padding). Types and token ids are left for the model's forward to check."""
    if isinstance(input_ids, (list, tuple)):
        if len(input_ids) == 0 or (isinstance(input_ids[0], (list, tuple)) and all(len(r) == 0 for r in input_ids)):
            raise ValueError(_empty_prompt_message(model.config))
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1:
            attention_mask = attention_mask.unsqueeze(0)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.numel() == 0:
        raise ValueError(_empty_prompt_message(model.config))
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return input_ids, None  # the model's forward says what is wrong
    input_ids = input_ids.to(model.input_device)
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = attention_mask
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}.")
    mask = attention_mask.to(input_ids.device) != 0
    if not bool(mask.any(1).all()):
        raise ValueError(_empty_prompt_message(model.config) + " (a row of attention_mask is all zeros)")
    if bool(mask[:, -1].all()):
        return input_ids, mask
    order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)  # padding first, then the real tokens
    return input_ids.gather(1, order), mask.gather(1, order)


def _check_length(config, mask: torch.Tensor, max_new_tokens) -> None:
    """BriLLM has one learned position weight per position: refuse, before generating, what would read past it."""
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}.")
    if getattr(config, "position_overflow", "error") == "extend":  # reads any length: no limit
        return
    longest, limit = int(mask.sum(1).max()), int(config.max_position_embeddings)
    if longest > limit:
        raise ValueError(f"the prompt holds {longest} tokens, more than max_position_embeddings={limit} of this "
                         f"model; shorten it to at most {limit - 1} tokens to leave room for new ones.")
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds max_position_embeddings="
            f"{limit} of this model: at most {limit - longest} new tokens fit (BriLLM has one learned position "
            "weight per position, so it cannot read past the last one; config.position_overflow=\"extend\" lifts "
            "the limit).")


def _settings(model, options: dict, tokenizer) -> GenerationConfig:
    """The call's options as a `GenerationConfig` checked by transformers (eos / pad ids default to the model's).
    Only what transformers does not check, or what this loop cannot do, is refused here."""
    num_beams, sample = options["num_beams"], options["do_sample"]
    if not isinstance(num_beams, int) or isinstance(num_beams, bool) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive integer (1 = no beam search), got {num_beams!r}.")
    if num_beams > 1 and sample:
        raise ValueError("beam search (num_beams > 1) is deterministic here: pass do_sample=False, or num_beams=1 "
                         "to sample.")
    if num_beams == 1 and options["num_return_sequences"] != 1:
        raise ValueError(f"num_return_sequences={options['num_return_sequences']!r} needs beam search (num_beams > 1);"
                         " to draw several samples per prompt, repeat the prompt rows.")
    stop_strings = options["stop_strings"]
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings needs the model's tokenizer to read the generated text: pass "
                             "tokenizer=... as well (as generate() does).")
        strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        if not strings or not all(isinstance(s, str) and s for s in strings):
            raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {stop_strings!r}.")
    for name in ("eos_token_id", "pad_token_id"):  # the call's, else the generation config's, else the config's
        for source in (getattr(model, "generation_config", None), model.config):
            if options[name] is None:
                options[name] = getattr(source, name, None)
    eos = options["eos_token_id"]  # as a list of ids: [] never ends a row early
    eos = eos.reshape(-1).tolist() if isinstance(eos, torch.Tensor) else [] if eos is None else eos
    eos = options["eos_token_id"] = [int(t) for t in (eos if isinstance(eos, (list, tuple, set)) else [eos])]
    if options["pad_token_id"] is None:
        options["pad_token_id"] = eos[0] if eos else 0
    unused = () if sample else ("temperature", "top_k", "top_p")  # left out: transformers would warn about them
    unused += () if num_beams > 1 else ("num_return_sequences", "length_penalty", "early_stopping")
    options["max_new_tokens"] = options["max_new_tokens"] or None  # 0 new tokens is fine here, not in transformers
    return GenerationConfig(**{name: value for name, value in options.items() if name not in unused})  # validates


def _processors(config: GenerationConfig, exclude_self_loops: bool) -> LogitsProcessorList:
    """The logits processors of `generate()` for these settings, in `generate()`'s order, for the loop of ours."""
    processors = LogitsProcessorList()
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        processors.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if exclude_self_loops:
        processors.append(SelfLoopBan())
    if config.do_sample:
        if config.temperature is not None and config.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(config.temperature))
        if config.top_k:
            processors.append(TopKLogitsWarper(config.top_k))
        if config.top_p is not None and config.top_p != 1.0:
            processors.append(TopPLogitsWarper(config.top_p))
    return processors


def _criteria(config: GenerationConfig, tokenizer, max_length: int) -> StoppingCriteriaList:
    criteria = StoppingCriteriaList([MaxLengthCriteria(max_length)])
    if config.eos_token_id:
        criteria.append(EosTokenCriteria(config.eos_token_id))
    if config.stop_strings is not None:
        criteria.append(StopStringCriteria(tokenizer, config.stop_strings))
    return criteria


def _path(raw, probabilities, sources, tokens, k: int) -> dict:
    """The energy-path fields of `tokens` chosen among the `raw` energies (..., V): energy, rank, probability and
    the k strongest other nodes. Works on any leading dimensions (one step of a batch, or whole beams)."""
    picked = tokens.clamp(0, raw.shape[-1] - 1).unsqueeze(-1)  # a finished row's pad id may lie outside [0, V)
    energy = raw.gather(-1, picked)
    alternatives = torch.topk(raw.scatter(-1, picked, float("-inf")), k, dim=-1)
    return {"sources": sources, "tokens": tokens, "energies": energy.squeeze(-1),
            "probabilities": probabilities.gather(-1, picked).squeeze(-1), "ranks": 1 + (raw > energy).sum(-1),
            "alternative_tokens": alternatives.indices, "alternative_energies": alternatives.values}


def _decode(model, input_ids, mask, start, config, processors, criteria, generator, streamer, k):
    """Greedy decoding or sampling on the model's recurrent state, in the loop `generate()` runs (`decode_loop`).
    Finished rows are fed the pad token, as `generate()` does. Returns the energy-path fields (batch, steps[, k])
    and the step mask; steps run after every row had finished are dropped."""
    B, T = input_ids.shape
    host_reads = config.no_repeat_ngram_size or streamer is not None  # they wait for the device every step anyway
    if streamer is not None:
        streamer.put(input_ids.cpu())
    out = model(input_ids, attention_mask=None if bool(mask.all()) else mask.long(), use_cache=True,
                logits_to_keep=1, **start)
    steps, last = [], [input_ids[:, -1]]

    def record(raw, scores, tokens, unfinished):
        steps.append((_path(raw, scores.softmax(-1), last[0], tokens, k), unfinished))
        last[0] = tokens

    run = Decoding(processors, criteria, T + config.max_new_tokens, config.do_sample,
                   torch.tensor(config.pad_token_id, device=input_ids.device), generator, streamer, record,
                   1 if host_reads else finish_check_every(input_ids.device))
    _, _, ran = decode_loop(input_ids, out.logits[:, -1, :].float(), out.state, model.loop_step(input_ids), run)
    if streamer is not None:
        streamer.end()
    steps = steps[:ran]
    fields = {name: torch.stack([f[name] for f, _ in steps], 1) for name in steps[0][0]}
    return fields, torch.stack([a for _, a in steps], 1)


def _beam_search(model, input_ids, mask, start, config, exclude_self_loops, tokenizer, streamer, k):
    """`generate()`'s own beam search, asked for its raw logits (the energies), scores and beam indices: each
    returned sequence's energy path is read from the rows of the beams it went through. Returns the path fields,
    the step mask and the sequences' scores."""
    processors = LogitsProcessorList([SelfLoopBan()] if exclude_self_loops else [])
    penalised = bool(processors) or config.no_repeat_ngram_size or config.repetition_penalty not in (None, 1.0)
    # renormalised when processors act, so that a beam's score is the sum of its recorded log-probabilities
    config.update(output_logits=True, output_scores=True, return_dict_in_generate=True,
                  renormalize_logits=bool(penalised))
    if not config.eos_token_id and not config.pad_token_id:  # generate() would read pad 0 as unset and fall back
        config.pad_token_id = 1  # on eos[0]; the value only fills ended beams, which are masked out below
    extra = {} if streamer is None else {"streamer": streamer}  # generate() says it cannot stream beams
    out = model.generate(input_ids, attention_mask=mask.long(), generation_config=config, logits_processor=processors,
                         tokenizer=tokenizer, **extra, **start)
    T, steps = input_ids.shape[1], out.beam_indices.shape[1]
    rows, at = out.beam_indices.clamp(min=0).long(), torch.arange(steps, device=out.beam_indices.device)
    raw = torch.stack(out.logits[:steps], 1)[rows, at]  # (sequences, steps, V): the energies each step saw
    log_probs = torch.stack(out.scores[:steps], 1)[rows, at]
    fields = _path(raw, log_probs.exp(), out.sequences[:, T - 1:T + steps - 1], out.sequences[:, T:T + steps], k)
    return fields, out.beam_indices >= 0, out.sequences_scores


def _output(fields, step_mask, prompt, mask, pad_token_id, tokenizer, sequences_scores=None):
    """`EnergyGenerateOutput` with the steps after a row finished masked: pad tokens, NaN energies, rank 0."""
    blank = ~step_mask
    for name, fill in (("tokens", pad_token_id), ("sources", pad_token_id), ("energies", float("nan")),
                       ("probabilities", float("nan")), ("ranks", 0)):
        fields[name] = fields[name].masked_fill(blank, fill)
    fields["alternative_tokens"] = fields["alternative_tokens"].masked_fill(blank.unsqueeze(2), -1)
    fields["alternative_energies"] = fields["alternative_energies"].masked_fill(blank.unsqueeze(2), float("nan"))
    steps = torch.arange(step_mask.shape[1], device=step_mask.device)
    return EnergyGenerateOutput(
        sequences=torch.cat([prompt, fields["tokens"]], 1), prompt_length=prompt.shape[1], step_mask=step_mask,
        positions=mask.sum(1, keepdim=True) + steps, attention_mask=torch.cat([mask.long(), step_mask.long()], 1),
        tokenizer=tokenizer, sequences_scores=sequences_scores, **fields)


def _no_steps(prompt, mask, copies: int, beams: bool, pad_token_id, tokenizer, k: int) -> EnergyGenerateOutput:
    """The output of `max_new_tokens=0`: every prompt row (`copies` times) and an empty energy path."""
    rows = torch.arange(prompt.shape[0], device=prompt.device).repeat_interleave(copies)
    B, device = len(rows), prompt.device
    long, real = torch.zeros(B, 0, dtype=torch.long, device=device), torch.zeros(B, 0, device=device)
    fields = {"sources": long, "tokens": long, "ranks": long, "energies": real, "probabilities": real,
              "alternative_tokens": torch.empty(B, 0, k, dtype=torch.long, device=device),
              "alternative_energies": torch.empty(B, 0, k, device=device)}
    return _output(fields, torch.zeros(B, 0, dtype=torch.bool, device=device), prompt[rows], mask[rows], pad_token_id,
                   tokenizer, torch.zeros(B, device=device) if beams else None)


@torch.no_grad()
def energy_generate(
    model,
    input_ids,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    repetition_penalty: float = 1.0,
    no_repeat_ngram_size: int = 0,
    exclude_self_loops: bool = True,
    eos_token_id: int | list[int] | None = None,
    num_alternatives: int = 5,
    generator: torch.Generator | None = None,
    pad_token_id: int | None = None,
    streamer=None,
    tokenizer=None,
    stop_strings: str | list[str] | None = None,
    num_beams: int = 1,
    num_return_sequences: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    signal_ids=None,
) -> EnergyGenerateOutput:
    """Decode with BriLLM's rule: every node v receives energy E_v = ‖GeLU(x·W[u→v] + b + PE)‖ from the node u
    the signal sits on; the next node is the most energetic (greedy) or drawn from softmax(E / temperature). The
    options mean what they mean for `generate()` (which checks them), and run in its loop (`decode_loop`):

        input_ids, attention_mask   (batch, length) ids (a list or 1-D tensor is one row), padding on either side
        max_new_tokens              new tokens per row (refused before decoding if they run past the trained range)
        do_sample, temperature, top_k, top_p, repetition_penalty, no_repeat_ngram_size, eos_token_id ([] never
        stops), pad_token_id, streamer, stop_strings (with `tokenizer`), signal_ids: as in `generate()`
        exclude_self_loops          never move from a node to itself (the release; False: `generate()`'s tokens)
        num_alternatives            runner-up nodes recorded per step; `generator` draws the samples
        num_beams, num_return_sequences, length_penalty, early_stopping: `generate()`'s own beam search, each
                                    sequence's path read back from its beam (row r·n + i: prompt r's i-th best)

    Returns an `EnergyGenerateOutput`: `sequences` and the energy path (`tokens`, `energies`, `ranks`,
    `probabilities`, `alternative_tokens`, `alternative_energies`, `step_mask`; beams: `sequences_scores`).
    """
    options = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k,
                   top_p=top_p, repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
                   eos_token_id=eos_token_id, pad_token_id=pad_token_id, stop_strings=stop_strings,
                   num_beams=num_beams, num_return_sequences=num_return_sequences, length_penalty=length_penalty,
                   early_stopping=early_stopping)
    input_ids, mask = _prompt(model, input_ids, attention_mask)
    if mask is None:  # not a (batch, length) tensor: the model's own input check explains what is wrong
        model(input_ids)
    _check_length(model.config, mask, max_new_tokens)
    config = _settings(model, options, tokenizer)
    k = max(0, min(int(num_alternatives), int(model.config.vocab_size) - 1))
    start = {} if signal_ids is None else {"signal_ids": signal_ids}  # only the prompt's call starts the signal
    if max_new_tokens == 0:
        model(input_ids, attention_mask=mask.long(), logits_to_keep=1, **start)  # the model checks the prompt
        return _no_steps(input_ids, mask, num_return_sequences, num_beams > 1, config.pad_token_id, tokenizer, k)
    if num_beams > 1:
        fields, step_mask, scores = _beam_search(model, input_ids, mask, start, config, exclude_self_loops,
                                                 tokenizer, streamer, k)
        rows = torch.arange(input_ids.shape[0], device=input_ids.device).repeat_interleave(num_return_sequences)
        return _output(fields, step_mask, input_ids[rows], mask[rows], config.pad_token_id, tokenizer, scores)
    criteria = _criteria(config, tokenizer, input_ids.shape[1] + max_new_tokens)
    fields, step_mask = _decode(model, input_ids, mask, start, config, _processors(config, exclude_self_loops),
                                criteria, generator, streamer, k)
    return _output(fields, step_mask, input_ids, mask, config.pad_token_id, tokenizer)


# ------------------------------------------------------------------------------------ custom_generate
_CUSTOM_GENERATE_WRAPPER = '''

# --------------------------------------------------------------------------------------------------------------
# transformers `custom_generate` entry point: model.generate(..., custom_generate=<this repo>, trust_remote_code=True)
def generate(model, input_ids=None, attention_mask=None, generation_config=None, inputs=None, streamer=None,
             return_dict_in_generate=None, **kwargs):
    """Runs `energy_generate` with the arguments of `generate()`; returns the sequences tensor, or the full
    `EnergyGenerateOutput` (energy path included) with return_dict_in_generate=True."""
    if input_ids is None:
        input_ids = inputs
    config = generation_config if generation_config is not None else model.generation_config
    names = set(inspect.signature(energy_generate).parameters) - {"model", "input_ids", "attention_mask"}
    options = {}
    for name in ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                 "no_repeat_ngram_size", "eos_token_id", "pad_token_id", "stop_strings", "num_beams",
                 "num_return_sequences", "length_penalty", "early_stopping"):
        value = getattr(config, name, None)
        if value is not None:
            options[name] = value
    if not options.get("no_repeat_ngram_size"):
        options.pop("no_repeat_ngram_size", None)
    options.update({k: v for k, v in kwargs.items() if k in names and v is not None})
    if "max_new_tokens" not in options:
        max_length = kwargs.get("max_length") or getattr(config, "max_length", None) or 20
        options["max_new_tokens"] = max(0, int(max_length) - input_ids.shape[-1])
    out = energy_generate(model, input_ids, attention_mask=attention_mask, streamer=streamer, **options)
    if return_dict_in_generate is None:
        return_dict_in_generate = getattr(config, "return_dict_in_generate", False)
    if return_dict_in_generate:
        return out
    return out.sequences
'''


def save_custom_generate(output_dir) -> str:
    """Write a standalone transformers `custom_generate` repository (to push as its own Hub repo, e.g.
    `org/brillm-energy-decoding`) whose `custom_generate/generate.py` is this module plus a `generate()` entry point:

        model.generate(input_ids, custom_generate="org/brillm-energy-decoding", trust_remote_code=True,
                       max_new_tokens=20, exclude_self_loops=True)

    Keep it out of model repositories: there transformers would replace `model.generate` itself.
    Returns the path of the written `generate.py`.
    """
    import os

    folder = os.path.join(os.fspath(output_dir), "custom_generate")
    os.makedirs(folder, exist_ok=True)
    # a standalone file: the decoding loop it shares with the model's generate() goes in by its source
    loop = "\n\n".join(inspect.getsource(obj) for obj in (finish_check_every, Decoding, decode_loop))
    source = inspect.getsource(inspect.getmodule(energy_generate)).replace(
        "from .generation import Decoding, decode_loop, finish_check_every\n",
        "import inspect\nimport torch.nn.functional as F\nfrom dataclasses import dataclass\n"
        "from transformers import MaxLengthCriteria\n\n" + loop + "\n")
    path = os.path.join(folder, "generate.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source + _CUSTOM_GENERATE_WRAPPER)
    with open(os.path.join(folder, "requirements.txt"), "w", encoding="utf-8") as f:
        f.write("torch\ntransformers\n")
    readme = os.path.join(os.fspath(output_dir), "README.md")
    if not os.path.exists(readme):
        with open(readme, "w", encoding="utf-8") as f:
            f.write(
                "---\nlibrary_name: transformers\ntags:\n- custom_generate\n- brillm\n---\n\n"
                "# BriLLM energy decoding\n\nBriLLM's own decoding rule (the next node is the one receiving the most "
                "energy), with the energy path recorded, as a transformers `custom_generate` recipe:\n\n"
                "```python\nout = model.generate(input_ids, custom_generate=\"<this repo>\", trust_remote_code=True,\n"
                "                     max_new_tokens=20, exclude_self_loops=True)\n```\n\n"
                "Pass `return_dict_in_generate=True` to get the energy path (energies, ranks, runner-ups).\n"
            )
    return path
