"""BriLLM's own decoding loop: the next node is the one whose incoming edge receives the most energy.

`energy_generate(model, input_ids, ...)` steps the model's O(d) recurrent state directly — one forward with
`past_key_values` and `logits_to_keep=1` per new token, no generic `generate()` machinery — and records the
energy path: for every step and row, the node the signal sits on, the chosen node, its energy (the L2 norm
delivered by its incoming edge, i.e. the raw logit), its rank among all V nodes, its probability under the
decoding distribution, and the strongest runner-up nodes with their energies.

Compared with the BriLLM0.5 release (see BRILLM_SPEC.md, "Decoding in the release, and its defects"):
  * positions: the model's recurrent state uses the teacher-forcing positions, so the energies seen while
    decoding are exactly the logits of a teacher-forced forward over the final sequence (release defect 1);
  * temperature divides the logits before the softmax (release defect 2: it divided the probabilities);
  * all candidates are scored in one batched call (release defect 3: per-candidate Python loops);
  * self-loops u→u are excluded as in the release by default (`exclude_self_loops=True`); pass False to decode
    exactly like `model.generate()`.

Plugging in. `BriLLMForCausalLM.energy_generate(input_ids, ...)` calls this function; the standard
`model.generate()` (and so `pipeline("text-generation")`) is untouched. This module imports nothing but torch
(it uses the model duck-typed), so it ships with saved models as remote code and can also be copied verbatim
into a standalone `custom_generate/generate.py` repository: see `save_custom_generate`. Such a folder is on
purpose *not* written into model repositories: transformers replaces `model.generate` by the repository's
custom function whenever a model is loaded with `trust_remote_code=True` and the folder exists, which would
change what `pipeline(...)` does.

Rows finish at an end-of-sequence token or at the token that completes a stop string; afterwards they are filled
with the pad token (as `generate()` does) and their steps are masked out of the energy path.

Beam search (`num_beams > 1`) follows `generate()`'s rules (see `energy_generate`) and scores with the log-softmax of
the energies used as logits; every returned sequence carries the energy path of its own beam.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field

import torch

__all__ = ["EnergyGenerateOutput", "EnergyStep", "energy_generate", "save_custom_generate"]


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


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()]
    if isinstance(value, (list, tuple, set)):
        return [int(v) for v in value]
    return [int(value)]


def _finish_check_every(device: torch.device) -> int:
    """How many steps energy_generate runs between two reads of "has every row finished?" from the device: 8 on a
    GPU (a read waits for the queued work), 1 elsewhere (a read is free, an extra step is not)."""
    return 8 if device.type == "cuda" else 1


def _left_align(input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Move every row's real tokens to the right end (left padding), keeping their order."""
    if bool(mask[:, -1].all()):
        return input_ids, mask
    order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)  # padding first, then the real tokens
    return input_ids.gather(1, order), mask.gather(1, order)


def _top_k_filter(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Keep the `top_k` largest logits of every row (ties at the threshold kept), as transformers' TopK warper."""
    top_k = min(max(int(top_k), 1), logits.shape[-1])
    threshold = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < threshold, float("-inf"))


def _top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Nucleus filter: the smallest set of nodes with probability mass >= top_p (as transformers' TopP warper)."""
    sorted_logits, sorted_idx = torch.sort(logits, descending=False, dim=-1)
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[..., -1:] = False  # always keep the most likely node
    remove = remove_sorted.scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def _banned_ngram_tokens(history: list[list[int]], n: int) -> list[list[int]]:
    """For every row, the tokens that would repeat an n-gram already in its history."""
    banned = []
    for tokens in history:
        if len(tokens) + 1 < n:
            banned.append([])
            continue
        prefix = tuple(tokens[len(tokens) - n + 1:])
        banned.append([tokens[i + n - 1] for i in range(len(tokens) - n + 1) if tuple(tokens[i:i + n - 1]) == prefix])
    return banned


def _constrain(raw, current, penalised, history, repetition_penalty, no_repeat_ngram_size, exclude_self_loops):
    """The decoding logits of one step: raw energies (rows, V) with the repetition penalty, n-gram bans and the
    self-loop ban applied (shared by greedy/sampling and beam search)."""
    logits = raw
    if penalised is not None:
        logits = torch.where(penalised, torch.where(logits < 0, logits * repetition_penalty,
                                                    logits / repetition_penalty), logits)
    if history is not None:
        banned = _banned_ngram_tokens(history, no_repeat_ngram_size)
        ban_rows = [r for r, b in enumerate(banned) for _ in b]
        if ban_rows:
            ban_tokens = [t for b in banned for t in b]
            index = (torch.tensor(ban_rows, device=raw.device), torch.tensor(ban_tokens, device=raw.device))
            logits = logits.index_put(index, torch.tensor(float("-inf"), device=raw.device))
    if exclude_self_loops:
        logits = logits.scatter(1, current.unsqueeze(1), float("-inf"))
    return logits


class _StopStrings:
    """Stop strings read the way `generate()`'s StopStringCriteria reads them: a row ends at the token that completes
    one of them (that token may run past the string's end, the string may span tokens and start in the prompt); a
    string that was already complete before the last token does not count again."""

    def __init__(self, tokenizer, stop_strings):
        self.tokenizer = tokenizer
        self.strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        if not self.strings or not all(isinstance(t, str) and t for t in self.strings):
            raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {stop_strings!r}.")
        # enough tokens to hold the longest string even when byte-level tokens carry a fraction of a character
        self.window = 4 * max(len(t) for t in self.strings) + 2

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def hit(self, ids: list[int]) -> bool:
        tail = ids[-self.window:]
        before, text = self._decode(tail[:-1]), self._decode(tail)
        start = len(before) if text.startswith(before) else len(_common_prefix(before, text))
        # an occurrence ending after `start` ends inside the last token's text
        return any(text.find(t, max(0, start - len(t) + 1)) != -1 for t in self.strings)


def _common_prefix(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


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
    """Decode with BriLLM's rule: at every step, every node v receives energy E_v = ‖GeLU(x·W[u→v] + b + PE)‖
    from the node u the signal sits on; the next node is the most energetic one (greedy) or is drawn from
    softmax(E / temperature) (sampling).

    Args:
        model: a `BriLLMForCausalLM` (anything with its forward signature and `config`).
        input_ids: `(batch, length)` token ids (a 1-D tensor or a list of ids is taken as one row). Must hold at
            least one real token per row; start from the BOS token for an unconditional sample.
        attention_mask: 1 for real tokens, 0 for padding; padding may be on either side (right-padded rows are
            moved to left padding, so `sequences` always continues each row at its last column).
        max_new_tokens: new tokens per row. A row's real length plus `max_new_tokens` may not exceed
            `config.max_position_embeddings` (`ValueError`, before generating, naming the largest value that fits)
            unless `config.position_overflow="extend"`, which has no limit.
        do_sample: draw from the distribution instead of taking the most energetic node.
        temperature: divides the energies (logits) before the softmax; only used when sampling. Must be > 0.
        top_k, top_p: keep the `top_k` most energetic nodes / the smallest set with probability mass `top_p`
            (sampling only, as in `generate()`).
        repetition_penalty: energies of nodes already in the row are divided by it (multiplied when negative),
            the CTRL penalty `generate()` uses; padding is ignored.
        no_repeat_ngram_size: forbid any n-gram of this size from occurring twice in a row (0 = off).
        exclude_self_loops: never move from a node to itself (the release does this). With False, greedy decoding
            equals `model.generate(do_sample=False)` token for token.
        eos_token_id: id or ids that end a row; None reads `model.generation_config` / `model.config`. Pass []
            to never stop early.
        num_alternatives: how many runner-up nodes (strongest other nodes by raw energy) to record per step.
        generator: a `torch.Generator` for reproducible sampling.
        pad_token_id: fills finished rows; defaults to the generation config's, then the first eos id.
        streamer: a transformers streamer (`TextStreamer`, ...); gets the prompt, then each new token (batch 1).
        tokenizer: kept on the output so `path()` / `to_records()` include token texts; needed by `stop_strings`.
        stop_strings: a string or list of strings ending a row (as in `generate()`): the row ends with the token
            that completes one (kept in the output, like an eos token), wherever the string's characters started;
            rows end independently. Needs `tokenizer`.
        num_beams: > 1 runs beam search (greedy only: `do_sample` must be False; no streamer). Every beam is scored
            by the sum of log-softmax(decoding logits) of its tokens, the decoding logits being the energies after
            the repetition penalty, n-gram and self-loop bans. The rules are `generate()`'s: at every step the
            2·num_beams (more with several eos ids) best continuations are kept; those ending at an eos token or a
            stop string (and only among the num_beams best) become finished hypotheses scored
            sum_logprobs / new_tokens ** length_penalty (new_tokens counts the ending token); the rest continue. At
            `max_new_tokens` the running beams are finished too. The best finished hypotheses are returned.
        num_return_sequences: how many of the best hypotheses to return per row (at most num_beams); the rows of
            `sequences` are then grouped by prompt: row r·n + i is prompt r's i-th best.
        length_penalty: exponent of the length normalisation (beam search): > 0 favours longer sequences, < 0
            shorter ones, 0 ranks by the plain sum of log-probabilities.
        early_stopping: beam search stopping, as in `generate()`: True stops a prompt as soon as num_beams
            hypotheses are finished; False (default) stops when the best running beam, normalised at the current
            length, can no longer beat the worst finished one; "never" uses the best length the running beams could
            still reach (the exact bound when length_penalty > 0).
        signal_ids: `(batch,)` learned start signal of each row (models with `start_signal="learned"`).

    Returns:
        `EnergyGenerateOutput` with `sequences` and the energy path (`tokens`, `energies`, `ranks`,
        `probabilities`, `alternative_tokens`, `alternative_energies`, `step_mask`, ...). With beams, the path of
        each returned sequence is that of its own beam (`probabilities` are exp of the scoring log-softmax) and
        `sequences_scores` holds the beam scores.
    """
    config = model.config
    V = int(config.vocab_size)
    max_positions = int(config.max_position_embeddings)

    # ---------------------------------------------------------------------------------------- validation
    if isinstance(input_ids, (list, tuple)):
        if len(input_ids) == 0 or (isinstance(input_ids[0], (list, tuple)) and all(len(r) == 0 for r in input_ids)):
            raise ValueError(_empty_prompt_message(config))
        input_ids = torch.as_tensor(input_ids, dtype=torch.long)
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a tensor or a list of token ids, got {type(input_ids).__name__}.")
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}.")
    if input_ids.dim() == 1:
        input_ids = input_ids.unsqueeze(0)
        if attention_mask is not None and attention_mask.dim() == 1:
            attention_mask = attention_mask.unsqueeze(0)
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}.")
    if input_ids.numel() == 0:
        raise ValueError(_empty_prompt_message(config))
    device = getattr(model, "device", input_ids.device)
    input_ids = input_ids.to(device=device, dtype=torch.long)
    B, T = input_ids.shape
    if attention_mask is None:
        mask = torch.ones(B, T, dtype=torch.bool, device=device)
    else:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (B, T):
            shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__
            raise ValueError(f"attention_mask must have the shape of input_ids {(B, T)}, got {shape}.")
        mask = attention_mask.to(device) != 0
    lengths = mask.sum(1)
    if bool((lengths == 0).any()):
        raise ValueError(_empty_prompt_message(config) + " (a row of attention_mask is all zeros)")
    real = input_ids[mask]
    low, high = int(real.min()), int(real.max())
    if low < 0 or high >= V:
        raise ValueError(
            f"token id {low if low < 0 else high} is outside the vocabulary [0, {V}) of this model; use the tokenizer "
            "the model was trained with."
        )
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative integer, got {max_new_tokens!r}.")
    longest = int(lengths.max())
    extends = getattr(config, "position_overflow", "error") == "extend"  # reads any length: no limit to check
    if not extends and longest > max_positions:
        raise ValueError(
            f"the prompt holds {longest} tokens, more than max_position_embeddings={max_positions} of this model; "
            f"shorten it to at most {max_positions - 1} tokens to leave room for new ones."
        )
    if not extends and longest + max_new_tokens > max_positions:
        raise ValueError(
            f"a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds max_position_embeddings="
            f"{max_positions} of this model: at most {max_positions - longest} new tokens fit (BriLLM has one learned "
            "position weight per position, so it cannot read past the last one; config.position_overflow=\"extend\" "
            "lifts the limit)."
        )
    if do_sample:
        if not (isinstance(temperature, (int, float)) and temperature > 0 and math.isfinite(temperature)):
            raise ValueError(f"temperature must be a positive number when sampling, got {temperature!r}; "
                             "use do_sample=False for greedy decoding.")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 0):
            raise ValueError(f"top_k must be a non-negative integer, got {top_k!r}.")
        if top_p is not None and not (0.0 < float(top_p) <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {top_p!r}.")
    if not (isinstance(repetition_penalty, (int, float)) and repetition_penalty > 0):
        raise ValueError(f"repetition_penalty must be a positive number, got {repetition_penalty!r}.")
    if not isinstance(num_beams, int) or isinstance(num_beams, bool) or num_beams < 1:
        raise ValueError(f"num_beams must be a positive integer (1 = no beam search), got {num_beams!r}.")
    if not isinstance(num_return_sequences, int) or isinstance(num_return_sequences, bool) or not (
            1 <= num_return_sequences <= num_beams):
        raise ValueError(f"num_return_sequences must be an integer between 1 and num_beams={num_beams}, got "
                         f"{num_return_sequences!r} (several sequences per prompt come from beam search; to draw "
                         "several samples, repeat the prompt rows).")
    if num_beams > 1:
        if do_sample:
            raise ValueError("beam search (num_beams > 1) is deterministic here: pass do_sample=False, or "
                             "num_beams=1 to sample.")
        if streamer is not None:
            raise ValueError("a streamer cannot follow beam search (num_beams > 1): the best beam is only known at "
                             "the end; use num_beams=1 to stream.")
        if early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}.")
        if not (isinstance(length_penalty, (int, float)) and math.isfinite(length_penalty)):
            raise ValueError(f"length_penalty must be a finite number, got {length_penalty!r}.")
    stop = None
    if stop_strings is not None:
        if tokenizer is None:
            raise ValueError("stop_strings needs the model's tokenizer to read the generated text: pass "
                             "tokenizer=... as well (as generate() does).")
        stop = _StopStrings(tokenizer, stop_strings)
    num_alternatives = max(0, min(int(num_alternatives), V - 1))

    generation_config = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(generation_config, "eos_token_id", None)
        if eos_token_id is None:
            eos_token_id = getattr(config, "eos_token_id", None)
    eos_ids = _as_id_list(eos_token_id)
    if pad_token_id is None:
        pad_token_id = getattr(generation_config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(config, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = eos_ids[0] if eos_ids else 0
    eos_tensor = torch.tensor(eos_ids, dtype=torch.long, device=device)

    input_ids, mask = _left_align(input_ids, mask)
    rows = torch.arange(B, device=device)
    penalised = None
    if repetition_penalty != 1.0:
        penalised = torch.zeros(B, V, dtype=torch.bool, device=device)
        penalised[rows.unsqueeze(1).expand(B, T)[mask], input_ids[mask]] = True
    history = [input_ids[r][mask[r]].tolist() for r in range(B)] if no_repeat_ngram_size > 0 else None
    texts = [input_ids[r][mask[r]].tolist() for r in range(B)] if stop is not None else None  # ids read by `stop`

    start = {} if signal_ids is None else {"signal_ids": signal_ids}  # only the first call starts the signal
    if num_beams > 1:
        return _beam_search(
            model, input_ids, mask, lengths, steps=max_new_tokens, num_beams=num_beams,
            num_return_sequences=num_return_sequences, length_penalty=float(length_penalty),
            early_stopping=early_stopping, constrain=lambda raw, current, pen, hist: _constrain(
                raw, current, pen, hist, repetition_penalty, no_repeat_ngram_size, exclude_self_loops),
            penalised=penalised, history=history, texts=texts, stop=stop, eos_tensor=eos_tensor,
            pad_token_id=int(pad_token_id), num_alternatives=num_alternatives, tokenizer=tokenizer, start=start)

    # ------------------------------------------------------------------------------------------- decoding
    # Per-step results are collected in lists and masked once at the end: the loop does the least work per token.
    # Without stop strings, n-gram bans or a streamer (which read tokens on the host) a step never waits for the
    # device: finished rows are tracked on it, and whether all rows have finished is read every `check_every` steps;
    # the steps run past the last active one are dropped at the end, so the result is the same as stopping at once.
    steps = max_new_tokens
    pad = torch.tensor(int(pad_token_id), dtype=torch.long, device=device)
    rec_tokens, rec_sources, rec_energies, rec_probs, rec_ranks, rec_alt_t, rec_alt_e, rec_active = ([] for _ in range(8))
    if streamer is not None:
        streamer.put(input_ids.cpu())
    active = torch.ones(B, dtype=torch.bool, device=device)
    can_end = eos_tensor.numel() > 0 or stop is not None
    host_reads = stop is not None or history is not None or streamer is not None
    check_every = 1 if host_reads else _finish_check_every(device)
    current = input_ids[:, -1]  # left-aligned: the last column is every row's last real token
    if steps:
        out = model(input_ids, attention_mask=None if bool(mask.all()) else mask.long(), use_cache=True,
                    logits_to_keep=1, **start)
    for s in range(steps):
        raw = out.logits[:, -1, :].float()  # energies of every node as the successor of `current`
        logits = _constrain(raw, current, penalised, history, repetition_penalty, no_repeat_ngram_size,
                            exclude_self_loops)
        if do_sample:
            if temperature != 1.0:
                logits = logits / temperature
            if top_k:
                logits = _top_k_filter(logits, top_k)
            if top_p is not None and top_p < 1.0:
                logits = _top_p_filter(logits, float(top_p))
        probs = torch.softmax(logits, dim=-1)
        if do_sample:
            chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        else:
            chosen = logits.argmax(dim=-1)
        if can_end:
            chosen = torch.where(active, chosen, pad)
        picked = chosen.unsqueeze(1)
        chosen_energy = raw.gather(1, picked)
        rec_tokens.append(chosen)
        rec_sources.append(current)
        rec_energies.append(chosen_energy.squeeze(1))
        rec_probs.append(probs.gather(1, picked).squeeze(1))
        rec_ranks.append(1 + (raw > chosen_energy).sum(1))
        rec_active.append(active)
        if num_alternatives:
            top = torch.topk(raw.scatter(1, picked, float("-inf")), num_alternatives, dim=1)
            rec_alt_t.append(top.indices)
            rec_alt_e.append(top.values)
        if penalised is not None:  # mark the chosen node of every active row (no boolean indexing: no host read)
            picked_rows = penalised.gather(1, picked) | active.unsqueeze(1)
            penalised.scatter_(1, picked, picked_rows)
        if history is not None:
            for r in active.nonzero().flatten().tolist():
                history[r].append(int(chosen[r]))
        if streamer is not None:
            streamer.put(chosen.cpu())

        ended = torch.isin(chosen, eos_tensor) if eos_tensor.numel() else None
        if stop is not None:
            hits = torch.zeros(B, dtype=torch.bool, device=device)
            for r in active.nonzero().flatten().tolist():
                texts[r].append(int(chosen[r]))
                hits[r] = stop.hit(texts[r])
            ended = hits if ended is None else ended | hits
        if ended is not None:
            active = active & ~ended
            if (s + 1) % check_every == 0 and not bool(active.any()):
                break
        if s + 1 == steps:
            break
        # Finished rows are fed their pad token like generate() does: their state is no longer used, and a full
        # batch keeps the model on its one-token decoding path. (Their length stays within max positions: at most
        # max_new_tokens - 1 steps are fed after a prompt that left room for max_new_tokens.)
        out = model(picked, past_key_values=out.past_key_values, use_cache=True, logits_to_keep=1,
                    generation_step=True)
        current = chosen
    if streamer is not None:
        streamer.end()

    if can_end and rec_active and check_every > 1:  # drop the steps run after every row had finished
        ran = int(torch.stack(rec_active).any(1).sum())
        for records in (rec_tokens, rec_sources, rec_energies, rec_probs, rec_ranks, rec_alt_t, rec_alt_e, rec_active):
            del records[ran:]
    done = len(rec_tokens)
    if done:
        step_mask = torch.stack(rec_active, 1)
        new_tokens = torch.stack(rec_tokens, 1)
        sources = torch.stack(rec_sources, 1).masked_fill(~step_mask, int(pad_token_id))
        energies = torch.stack(rec_energies, 1).masked_fill(~step_mask, float("nan"))
        probabilities = torch.stack(rec_probs, 1).masked_fill(~step_mask, float("nan"))
        ranks = torch.stack(rec_ranks, 1).masked_fill(~step_mask, 0)
        if num_alternatives:
            alt_tokens = torch.stack(rec_alt_t, 1).masked_fill(~step_mask.unsqueeze(2), -1)
            alt_energies = torch.stack(rec_alt_e, 1).masked_fill(~step_mask.unsqueeze(2), float("nan"))
        else:
            alt_tokens = torch.empty(B, done, 0, dtype=torch.long, device=device)
            alt_energies = torch.empty(B, done, 0, device=device)
    else:
        step_mask = torch.zeros(B, 0, dtype=torch.bool, device=device)
        new_tokens = sources = ranks = torch.zeros(B, 0, dtype=torch.long, device=device)
        energies = probabilities = torch.zeros(B, 0, device=device)
        alt_tokens = torch.empty(B, 0, num_alternatives, dtype=torch.long, device=device)
        alt_energies = torch.empty(B, 0, num_alternatives, device=device)
    return EnergyGenerateOutput(
        sequences=torch.cat([input_ids, new_tokens], 1),
        prompt_length=T,
        sources=sources,
        tokens=new_tokens,
        energies=energies,
        ranks=ranks,
        probabilities=probabilities,
        alternative_tokens=alt_tokens,
        alternative_energies=alt_energies,
        step_mask=step_mask,
        positions=lengths.unsqueeze(1) + torch.arange(done, device=device),
        attention_mask=torch.cat([mask.long(), step_mask.long()], 1),
        tokenizer=tokenizer,
    )


_NO_SCORE = float("-inf")  # score of an empty slot among the finished hypotheses


def _gather_beams(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor (B, N, ...) → (B, K, ...) taking along dim 1 the entries `index` (B, K)."""
    shape = index.shape + tensor.shape[2:]
    return tensor.gather(1, index.view(*index.shape, *([1] * (tensor.dim() - 2))).expand(shape))


def _beam_search(model, input_ids, mask, lengths, *, steps, num_beams, num_return_sequences, length_penalty,
                 early_stopping, constrain, penalised, history, texts, stop, eos_tensor, pad_token_id,
                 num_alternatives, tokenizer, start=None) -> EnergyGenerateOutput:
    """Beam search over BriLLM's recurrent state with `generate()`'s rules (see `energy_generate`), carrying each
    beam's energy path along: every running beam and every finished hypothesis owns its recorded steps."""
    device = input_ids.device
    B, T = input_ids.shape
    V = int(model.config.vocab_size)
    nb = num_beams
    keep = min(max(2, 1 + eos_tensor.numel()) * nb, nb * V)  # continuations kept per step, as generate()
    first_nb = torch.arange(keep, device=device) < nb  # only these may become finished hypotheses
    S = steps
    k = num_alternatives

    def blank(n):  # empty energy-path records for (B, n) beams: the values masked steps show
        return {
            "tokens": torch.full((B, n, S), pad_token_id, dtype=torch.long, device=device),
            "sources": torch.full((B, n, S), pad_token_id, dtype=torch.long, device=device),
            "energies": torch.full((B, n, S), float("nan"), device=device),
            "probabilities": torch.full((B, n, S), float("nan"), device=device),
            "ranks": torch.zeros(B, n, S, dtype=torch.long, device=device),
            "alternative_tokens": torch.full((B, n, S, k), -1, dtype=torch.long, device=device),
            "alternative_energies": torch.full((B, n, S, k), float("nan"), device=device),
        }

    run = blank(nb)
    run_scores = torch.zeros(B, nb, device=device)
    run_scores[:, 1:] = -1e9  # all beams start equal: only the first one's continuations count at step 0
    fin = blank(nb)
    fin_scores = torch.full((B, nb), _NO_SCORE, device=device)
    fin_length = torch.zeros(B, nb, dtype=torch.long, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)  # generate()'s early-stop heuristic
    batch_offset = torch.arange(B, device=device).unsqueeze(1) * nb

    if S:  # the prompt is read once per row, then its state is copied to the row's beams
        out = model(input_ids, attention_mask=None if bool(mask.all()) else mask.long(), use_cache=True,
                    logits_to_keep=1, **(start or {}))
        expand = torch.arange(B, device=device).repeat_interleave(nb)
        state = out.past_key_values.reorder_cache(expand)
        raw = out.logits[:, -1, :].float().index_select(0, expand)  # (B·nb, V)
        current = input_ids[:, -1].index_select(0, expand)
        if penalised is not None:
            penalised = penalised.index_select(0, expand)
        history = [list(history[r]) for r in expand.tolist()] if history is not None else None
        texts = [list(texts[r]) for r in expand.tolist()] if texts is not None else None
    for s in range(S):
        logprobs = torch.log_softmax(constrain(raw, current, penalised, history), dim=-1)  # (B·nb, V)
        total = (logprobs.view(B, nb, V) + run_scores.unsqueeze(2)).view(B, nb * V)
        top_scores, top_index = torch.topk(total, keep, dim=1)  # (B, keep)
        parent, token = top_index // V, top_index % V
        parent_row = parent + batch_offset  # row of the parent beam in the (B·nb) state

        # the candidates' energy paths: the parent's steps plus this one
        cand = {name: _gather_beams(value, parent) for name, value in run.items()}
        energies = raw[parent_row]  # (B, keep, V)
        energy = energies.gather(2, token.unsqueeze(2))
        cand["tokens"][:, :, s] = token
        cand["sources"][:, :, s] = current[parent_row]
        cand["energies"][:, :, s] = energy.squeeze(2)
        cand["probabilities"][:, :, s] = logprobs[parent_row, token].exp()
        cand["ranks"][:, :, s] = 1 + (energies > energy).sum(2)
        if k:
            alternatives = torch.topk(energies.scatter(2, token.unsqueeze(2), float("-inf")), k, dim=2)
            cand["alternative_tokens"][:, :, s] = alternatives.indices
            cand["alternative_energies"][:, :, s] = alternatives.values

        ends = torch.isin(token, eos_tensor) if eos_tensor.numel() else torch.zeros_like(token, dtype=torch.bool)
        if stop is not None:
            rows, tokens = parent_row.view(-1).tolist(), token.view(-1).tolist()
            ends |= torch.tensor([stop.hit(texts[r] + [t]) for r, t in zip(rows, tokens)],
                                 device=device).view(B, keep)
        if s + 1 == S:
            ends = torch.ones_like(ends)  # the last step finishes every beam

        # the num_beams best continuations that did not end go on
        go_on = torch.topk(top_scores.masked_fill(ends, -1e9), nb, dim=1).indices
        run = {name: _gather_beams(value, go_on) for name, value in cand.items()}
        run_scores = top_scores.masked_fill(ends, -1e9).gather(1, go_on)
        # the ended ones among the num_beams best enter the finished hypotheses, if they may still improve them
        scores = top_scores / float(s + 1) ** length_penalty
        may_add = improvable & ~(torch.isfinite(fin_scores).all(1, keepdim=True) & (early_stopping is True))
        scores = scores.masked_fill(~(ends & first_nb & may_add), _NO_SCORE)
        merged_scores = torch.cat([fin_scores, scores], 1)
        best = torch.topk(merged_scores, nb, dim=1).indices
        fin = {name: _gather_beams(torch.cat([fin[name], cand[name]], 1), best) for name in fin}
        fin_scores = merged_scores.gather(1, best)
        fin_length = torch.cat([fin_length, torch.full_like(token, s + 1)], 1).gather(1, best)

        full = torch.isfinite(fin_scores).all(1, keepdim=True)
        reach = S if (early_stopping == "never" and length_penalty > 0) else s + 1
        best_running = run_scores[:, :1] / float(reach) ** length_penalty
        improvable = improvable & (~full | (best_running > fin_scores.min(1, keepdim=True).values))
        if s + 1 == S or bool(ends.all()) or not bool(improvable.any()) or (early_stopping is True and bool(full.all())):
            break

        # move the state (and per-beam bookkeeping) to the surviving beams, then feed their new tokens
        order = parent_row.gather(1, go_on).view(-1)
        chosen = run["tokens"][:, :, s].reshape(-1)
        state = state.reorder_cache(order)
        if penalised is not None:
            penalised = penalised.index_select(0, order)
            penalised[torch.arange(B * nb, device=device), chosen] = True
        new_ids = chosen.tolist()
        if history is not None:
            history = [history[r] + [t] for r, t in zip(order.tolist(), new_ids)]
        if texts is not None:
            texts = [texts[r] + [t] for r, t in zip(order.tolist(), new_ids)]
        out = model(chosen.unsqueeze(1), past_key_values=state, use_cache=True, logits_to_keep=1,
                    generation_step=True)
        state = out.past_key_values
        raw = out.logits[:, -1, :].float()
        current = chosen

    # the best num_return_sequences finished hypotheses of every row, grouped by row
    n = num_return_sequences
    length = fin_length[:, :n].reshape(-1)
    G = int(length.max()) if S else 0
    records = {name: value[:, :n, :G].reshape(B * n, G, *value.shape[3:]) for name, value in fin.items()}
    step_mask = torch.arange(G, device=device) < length.unsqueeze(1)
    prompt_rows = torch.arange(B, device=device).repeat_interleave(n)
    return EnergyGenerateOutput(
        sequences=torch.cat([input_ids[prompt_rows], records["tokens"]], 1),
        prompt_length=T,
        step_mask=step_mask,
        positions=lengths[prompt_rows].unsqueeze(1) + torch.arange(G, device=device),
        attention_mask=torch.cat([mask[prompt_rows].long(), step_mask.long()], 1),
        tokenizer=tokenizer,
        sequences_scores=fin_scores[:, :n].reshape(-1) if S else torch.zeros(B * n, device=device),
        **records,
    )


def _empty_prompt_message(config) -> str:
    bos = getattr(config, "bos_token_id", None)
    hint = f" (this model's BOS id is {bos}: input_ids=[[{bos}]])" if bos is not None else ""
    return ("empty prompt: BriLLM needs at least one token per row to start the signal from; start an "
            f"unconditional sample from the BOS token{hint}.")


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
    if return_dict_in_generate if return_dict_in_generate is not None else getattr(config, "return_dict_in_generate", False):
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
    source = inspect.getsource(inspect.getmodule(energy_generate))
    path = os.path.join(folder, "generate.py")
    with open(path, "w", encoding="utf-8") as f:
        f.write(source + _CUSTOM_GENERATE_WRAPPER)
    with open(os.path.join(folder, "requirements.txt"), "w", encoding="utf-8") as f:
        f.write("torch\n")
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
