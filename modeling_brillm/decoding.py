"""BriLLM's own decoding, `energy_generate`: the next node is the one whose incoming edge delivers the most energy,
with the energy path recorded (every step's source, choice, energy, rank, probability and runner-ups). It runs in
`generate()`'s loop (`generation.decode_loop`); beam search is `generate()`'s own, read back from its logits.
`save_custom_generate` writes it as a standalone transformers `custom_generate` repository."""

import inspect
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
from transformers import (
    EosTokenCriteria,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .generation import Decoding, decode_loop, finish_check_every

# energy_generate's options that are generate()'s and go into its GenerationConfig
GENERATE_OPTIONS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "repetition_penalty",
                    "no_repeat_ngram_size", "eos_token_id", "pad_token_id", "stop_strings", "num_beams",
                    "num_return_sequences", "length_penalty", "early_stopping")


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([int(token_id)], skip_special_tokens=False, clean_up_tokenization_spaces=False)


class PathStep:
    """A step of an energy path (a dataclass with `alternatives`, `source_text` and `alternative_texts`)."""

    def to_record(self) -> dict:
        """The step as a JSON-ready dict: alternatives as {"token", "energy"[, "text"]}, texts when known."""
        record = {f.name: getattr(self, f.name) for f in fields(self)}
        texts = record.pop("alternative_texts") or []
        record["alternatives"] = [{"token": t, "energy": e} for t, e in self.alternatives]
        if self.source_text is None:
            return {name: value for name, value in record.items() if not name.endswith("_text")}
        for alternative, text in zip(record["alternatives"], texts):
            alternative["text"] = text
        return record


@dataclass
class EnergyStep(PathStep):
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


@dataclass
class EnergyGenerateOutput:
    """Result of `energy_generate`; the steps after a row finished are pad tokens (energy NaN, rank 0)."""

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
        for s in range(int(self.step_mask[row].sum())):  # a row's real steps come first, its finished ones after
            alt_t = self.alternative_tokens[row, s].tolist()
            step = EnergyStep(s, int(self.positions[row, s]), int(self.sources[row, s]), int(self.tokens[row, s]),
                              float(self.energies[row, s]), int(self.ranks[row, s]), float(self.probabilities[row, s]),
                              list(zip(alt_t, self.alternative_energies[row, s].tolist())))
            if tokenizer is not None:
                step.source_text, step.token_text, *step.alternative_texts = (
                    token_text(tokenizer, t) for t in (step.source, step.token, *alt_t))
            steps.append(step)
        return steps

    def to_records(self, tokenizer=None) -> list[list[dict]]:
        """JSON-ready: for every row, the list of its steps as dicts."""
        return [[s.to_record() for s in self.path(r, tokenizer)] for r in range(self.sequences.shape[0])]


class SelfLoopBan(LogitsProcessor):
    """Forbids the move u→u: the node the signal sits on (each row's last token) may not follow itself."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        return scores.scatter(1, input_ids[:, -1:], float("-inf"))


def _empty_prompt(config, why: str = "") -> ValueError:
    bos = getattr(config, "bos_token_id", None)
    hint = f" (this model's BOS id is {bos}: input_ids=[[{bos}]])" if bos is not None else ""
    return ValueError("empty prompt: BriLLM needs at least one token per row to start the signal from; start an "
                      f"unconditional sample from the BOS token{hint}.{why}")


def _prompt(model, input_ids, attention_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch, length) ids and boolean mask on the input device, left-padded (no mask: for the forward to refuse)."""
    if isinstance(input_ids, (list, tuple)):  # [] and [[]] become empty tensors, refused below
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 1:
            attention_mask = attention_mask.unsqueeze(0)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        return input_ids, None
    if input_ids.numel() == 0:
        raise _empty_prompt(model.config)
    input_ids = input_ids.to(model.input_device)
    if attention_mask is None:
        return input_ids, torch.ones_like(input_ids, dtype=torch.bool)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.shape != input_ids.shape:
        got = attention_mask
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, got {shape}.")
    mask = attention_mask.to(input_ids.device) != 0
    if not bool(mask.any(1).all()):
        raise _empty_prompt(model.config, " (a row of attention_mask is all zeros)")
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
        raise ValueError(f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds "
                         f"max_position_embeddings={limit} of this model: at most {limit - longest} new tokens fit "
                         "(BriLLM has one learned position weight per position, so it cannot read past the last one; "
                         "config.position_overflow=\"extend\" lifts the limit).")


def _settings(model, options: dict, tokenizer) -> GenerationConfig:
    """The options as a `GenerationConfig`, which checks them; refused here: what it lets by or this loop can't do."""
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
    """The logits processors of `generate()` for these settings, in `generate()`'s order."""
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


def path_fields(raw, probabilities, sources, tokens, k: int) -> dict:
    """The energy-path fields of `tokens` chosen among the `raw` energies (..., V), on any leading dimensions."""
    picked = tokens.clamp(0, raw.shape[-1] - 1).unsqueeze(-1)  # a finished row's pad id may lie outside [0, V)
    energy = raw.gather(-1, picked)
    alternatives = torch.topk(raw.scatter(-1, picked, float("-inf")), k, dim=-1)
    return {"sources": sources, "tokens": tokens, "energies": energy.squeeze(-1),
            "probabilities": probabilities.gather(-1, picked).squeeze(-1), "ranks": 1 + (raw > energy).sum(-1),
            "alternative_tokens": alternatives.indices, "alternative_energies": alternatives.values}


def _decode(model, input_ids, mask, start, config, exclude_self_loops, tokenizer, generator, streamer, k):
    """Greedy decoding or sampling in `decode_loop`: the path fields (batch, steps[, k]), the step mask, no scores."""
    T, criteria = input_ids.shape[1], StoppingCriteriaList()  # the loop itself stops at the length
    if config.eos_token_id:
        criteria.append(EosTokenCriteria(config.eos_token_id))
    if config.stop_strings is not None:
        criteria.append(StopStringCriteria(tokenizer, config.stop_strings))
    host_reads = config.no_repeat_ngram_size or streamer is not None  # they wait for the device every step anyway
    if streamer is not None:
        streamer.put(input_ids.cpu())
    out = model(input_ids, attention_mask=None if bool(mask.all()) else mask.long(), use_cache=True,
                logits_to_keep=1, **start)
    steps, last = [], [input_ids[:, -1]]

    def record(raw, scores, tokens, unfinished):
        steps.append((path_fields(raw, scores.softmax(-1), last[0], tokens, k), unfinished))
        last[0] = tokens

    run = Decoding(_processors(config, exclude_self_loops), criteria, T + config.max_new_tokens, config.do_sample,
                   torch.tensor(config.pad_token_id, device=input_ids.device), generator, streamer, record,
                   1 if host_reads else finish_check_every(input_ids.device))
    _, _, ran = decode_loop(input_ids, out.logits[:, -1, :].float(), out.state, model.loop_step(input_ids), run)
    if streamer is not None:
        streamer.end()
    steps = steps[:ran]
    fields = {name: torch.stack([f[name] for f, _ in steps], 1) for name in steps[0][0]}
    return fields, torch.stack([a for _, a in steps], 1), None


def _beam_search(model, input_ids, mask, start, config, exclude_self_loops, tokenizer, streamer, k):
    """`generate()`'s beam search; a sequence's path read from the logits and scores of the beams it went through."""
    processors = LogitsProcessorList([SelfLoopBan()] if exclude_self_loops else [])
    penalised = bool(processors) or config.no_repeat_ngram_size or config.repetition_penalty not in (None, 1.0)
    # renormalised when processors act, so that a beam's score is the sum of its recorded log-probabilities
    config.update(output_logits=True, output_scores=True, return_dict_in_generate=True,
                  renormalize_logits=bool(penalised))
    if not config.eos_token_id and not config.pad_token_id:  # generate() would read pad 0 as unset and fall back
        config.pad_token_id = 1  # on eos[0]; the value only fills ended beams, which are masked out below
    out = model.generate(input_ids, attention_mask=mask.long(), generation_config=config, logits_processor=processors,
                         tokenizer=tokenizer, streamer=streamer, **start)  # generate() says it cannot stream beams
    T, steps = input_ids.shape[1], out.beam_indices.shape[1]
    rows, at = out.beam_indices.clamp(min=0).long(), torch.arange(steps, device=out.beam_indices.device)
    raw = torch.stack(out.logits[:steps], 1)[rows, at]  # (sequences, steps, V): the energies each step saw
    log_probs = torch.stack(out.scores[:steps], 1)[rows, at]
    fields = path_fields(raw, log_probs.exp(), out.sequences[:, T - 1:T + steps - 1], out.sequences[:, T:T + steps], k)
    return fields, out.beam_indices >= 0, out.sequences_scores


def _output(fields, step_mask, prompt, mask, copies: int, pad_token_id, tokenizer, sequences_scores=None):
    """`EnergyGenerateOutput` of each prompt row `copies` times; steps after a row finished: pad, NaN, rank 0."""
    fills = {"tokens": pad_token_id, "sources": pad_token_id, "energies": float("nan"), "probabilities": float("nan"),
             "ranks": 0, "alternative_tokens": -1, "alternative_energies": float("nan")}
    blank = ~step_mask
    fields = {name: t.masked_fill(blank if t.dim() == 2 else blank[..., None], fills[name])
              for name, t in fields.items()}
    prompt, mask = prompt.repeat_interleave(copies, 0), mask.repeat_interleave(copies, 0)
    steps = torch.arange(step_mask.shape[1], device=step_mask.device)
    return EnergyGenerateOutput(
        sequences=torch.cat([prompt, fields["tokens"]], 1), prompt_length=prompt.shape[1], step_mask=step_mask,
        positions=mask.sum(1, keepdim=True) + steps, attention_mask=torch.cat([mask.long(), step_mask.long()], 1),
        tokenizer=tokenizer, sequences_scores=sequences_scores, **fields)


@torch.no_grad()
def energy_generate(model, input_ids, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 20,
                    do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                    top_p: float | None = None, repetition_penalty: float = 1.0, no_repeat_ngram_size: int = 0,
                    exclude_self_loops: bool = True, eos_token_id: int | list[int] | None = None,
                    num_alternatives: int = 5, generator: torch.Generator | None = None,
                    pad_token_id: int | None = None, streamer=None, tokenizer=None,
                    stop_strings: str | list[str] | None = None, num_beams: int = 1, num_return_sequences: int = 1,
                    length_penalty: float = 1.0, early_stopping: bool | str = False,
                    signal_ids=None) -> EnergyGenerateOutput:
    """Decode with BriLLM's rule, the next node the one receiving the most energy (greedy) or drawn from softmax(E /
    temperature), and record the energy path. `input_ids` (batch, length) (a list or 1-D tensor is one row), padded
    on either side; the options mean what they mean for `generate()` (`eos_token_id=[]` never stops; beams: row
    r·n + i is prompt r's i-th best of n). `exclude_self_loops`: never move from a node to itself, as the release;
    `num_alternatives`: runner-ups recorded per step; `generator` draws the samples."""
    options = {name: value for name, value in locals().items() if name in GENERATE_OPTIONS}
    input_ids, mask = _prompt(model, input_ids, attention_mask)
    if mask is None:  # not a (batch, length) tensor: the model's own input check explains what is wrong
        model(input_ids)
    _check_length(model.config, mask, max_new_tokens)
    config = _settings(model, options, tokenizer)
    V = int(model.config.vocab_size)
    k = max(0, min(int(num_alternatives), V - 1))
    start = {} if signal_ids is None else {"signal_ids": signal_ids}  # only the prompt's call starts the signal
    if max_new_tokens == 0:  # every prompt row and an empty energy path
        model(input_ids, attention_mask=mask.long(), logits_to_keep=1, **start)  # the model checks the prompt
        n = input_ids.shape[0] * num_return_sequences
        none, ids = torch.zeros(n, 0, V, device=input_ids.device), input_ids.new_zeros(n, 0)
        fields, step_mask = path_fields(none, none, ids, ids, k), torch.zeros_like(ids, dtype=torch.bool)
        scores = torch.zeros(n, device=input_ids.device) if num_beams > 1 else None
    elif num_beams > 1:
        fields, step_mask, scores = _beam_search(model, input_ids, mask, start, config, exclude_self_loops,
                                                 tokenizer, streamer, k)
    else:
        fields, step_mask, scores = _decode(model, input_ids, mask, start, config, exclude_self_loops, tokenizer,
                                            generator, streamer, k)
    # num_return_sequences > 1 only with beams (_settings)
    return _output(fields, step_mask, input_ids, mask, num_return_sequences, config.pad_token_id, tokenizer, scores)


_CUSTOM_GENERATE_README = (
    "---\nlibrary_name: transformers\ntags:\n- custom_generate\n- brillm\n---\n\n# BriLLM energy decoding\n\n"
    "BriLLM's own decoding rule (the next node is the one receiving the most energy), with the energy path recorded:"
    '\n\n```python\nout = model.generate(input_ids, custom_generate="<this repo>", trust_remote_code=True, '
    "max_new_tokens=20)\n```\n\nPass `return_dict_in_generate=True` to get the energy path (energies, ranks, "
    "runner-ups).\n")


def save_custom_generate(output_dir) -> str:
    """Write this module, `generate` its entry point, as a transformers `custom_generate` repository (its own Hub repo,
    never a model's, where it would replace `model.generate`). Returns the path of its generate.py."""
    folder = Path(output_dir) / "custom_generate"
    folder.mkdir(parents=True, exist_ok=True)
    # a standalone file: the decoding loop it shares with the model's generate() goes in by its source
    loop = "\n\n".join(inspect.getsource(obj) for obj in (finish_check_every, Decoding, decode_loop))
    source = inspect.getsource(inspect.getmodule(energy_generate)).replace(
        "from .generation import Decoding, decode_loop, finish_check_every\n",
        "import torch.nn.functional as F\nfrom transformers import MaxLengthCriteria\n\n" + loop + "\n")
    (folder / "generate.py").write_text(source, encoding="utf-8")
    (folder / "requirements.txt").write_text("torch\ntransformers\n", encoding="utf-8")
    if not (folder.parent / "README.md").exists():
        (folder.parent / "README.md").write_text(_CUSTOM_GENERATE_README, encoding="utf-8")
    return str(folder / "generate.py")


def generate(model, input_ids=None, attention_mask=None, generation_config=None, inputs=None, streamer=None,
             return_dict_in_generate=None, **kwargs):
    """`custom_generate`'s entry point: `energy_generate` with `generate()`'s arguments and return_dict_in_generate."""
    input_ids = inputs if input_ids is None else input_ids
    config = generation_config if generation_config is not None else model.generation_config
    options = {name: getattr(config, name) for name in GENERATE_OPTIONS if getattr(config, name, None) is not None}
    names = set(inspect.signature(energy_generate).parameters) - {"model", "input_ids", "attention_mask"}
    options.update({k: v for k, v in kwargs.items() if k in names and v is not None})
    if "max_new_tokens" not in options:
        max_length = kwargs.get("max_length") or getattr(config, "max_length", None) or 20
        options["max_new_tokens"] = max(0, int(max_length) - input_ids.shape[-1])
    out = energy_generate(model, input_ids, attention_mask=attention_mask, streamer=streamer, **options)
    if return_dict_in_generate is None:
        return_dict_in_generate = getattr(config, "return_dict_in_generate", False)
    return out if return_dict_in_generate else out.sequences
