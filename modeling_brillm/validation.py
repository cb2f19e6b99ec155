"""Input checks: bad input gets an error that names the problem and the fix, before any tensor math runs."""

import torch


def too_long(longest: int, max_positions: int) -> ValueError:
    """The error for a sequence that runs past the trained positions."""
    return ValueError(f"sequence of {longest} tokens exceeds max_position_embeddings={max_positions} of this model; "
                      "shorten the input (or generate fewer tokens), or split the text into blocks of at most "
                      f"{max_positions} tokens, or set config.position_overflow=\"extend\" to read past the trained "
                      "range.")


def check_inputs(input_ids, attention_mask, state, vocab_size: int) -> torch.Tensor:
    """Validate a forward call's ids, mask and state; returns the boolean mask of real tokens (B, T)."""
    if input_ids is None:
        raise ValueError("input_ids is required: BriLLM reads token ids (it has no input embeddings).")
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.LongTensor of shape (batch, length), got "
                        f"{type(input_ids).__name__}.")
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}; convert with "
                        "input_ids.long() if they are ids, or tokenize the text first.")
    if input_ids.dim() != 2:
        hint = "; add a batch dimension with input_ids.unsqueeze(0)" if input_ids.dim() == 1 else ""
        raise ValueError(f"input_ids must have shape (batch, length), got {tuple(input_ids.shape)}{hint}.")
    if input_ids.numel() == 0:
        raise ValueError(f"empty input: input_ids has shape {tuple(input_ids.shape)}; give at least one token per row.")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size}) of this model; use the tokenizer "
                         "the model was trained with.")
    B, T = input_ids.shape
    if state is not None and state.batch_size != B:
        raise ValueError(f"the cache holds {state.batch_size} sequences but input_ids has {B} rows.")
    if attention_mask is None:
        return torch.ones_like(input_ids, dtype=torch.bool)
    wrong = (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2 or attention_mask.shape[0] != B
             or attention_mask.shape[1] < T or (state is None and attention_mask.shape[1] != T))
    if wrong:
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, torch.Tensor) else \
            type(attention_mask).__name__
        raise ValueError(f"attention_mask must have the shape of input_ids {(B, T)} (or cover the past columns too "
                         f"when a cache is given), got {shape}.")
    mask = attention_mask[:, -T:].to(input_ids.device) != 0
    if state is None and not bool(mask.any(1).all()):
        raise ValueError("a row of attention_mask is all zeros: every sequence needs at least one real token.")
    return mask


def compact_real_tokens(input_ids: torch.Tensor, mask: torch.Tensor):
    """Move each row's real tokens to the front, so padding on either side (or holes) is simply skipped."""
    B, T = input_ids.shape
    lengths = mask.sum(1)
    L = int(lengths.max())
    if bool(mask.all()):
        column = torch.arange(T, device=input_ids.device).expand(B, T)
    else:
        column = torch.argsort((~mask).to(torch.int8), dim=1, stable=True)[:, :L]
    valid = torch.arange(L, device=input_ids.device) < lengths.unsqueeze(1)
    return input_ids.gather(1, column), valid, column, lengths


def check_signal_ids(signal_ids, config, batch: int, device) -> torch.Tensor | None:
    """(B,) long start-signal ids on `device`, or None for the uniform start (or no signal_ids on learned)."""
    if signal_ids is None:
        return None
    if config.start_signal != "learned":
        raise ValueError("signal_ids needs a model with start_signal='learned' (this one starts every sequence "
                         "from the uniform 1/d signal); set config.start_signal='learned' or drop signal_ids.")
    signal_ids = torch.as_tensor(signal_ids, device=device)
    if signal_ids.dim() == 0:
        signal_ids = signal_ids.expand(batch)
    if signal_ids.is_floating_point() or signal_ids.dtype == torch.bool or tuple(signal_ids.shape) != (batch,):
        raise ValueError(f"signal_ids must be integer ids of shape (batch,) = ({batch},), got "
                         f"{tuple(signal_ids.shape)} {signal_ids.dtype}.")
    n = config.num_start_signals
    if signal_ids.numel() and (int(signal_ids.min()) < 0 or int(signal_ids.max()) >= n):
        bad = int(signal_ids.min()) if int(signal_ids.min()) < 0 else int(signal_ids.max())
        raise ValueError(f"signal_ids value {bad} is outside [0, {n}): this model has num_start_signals={n}; "
                         "use an id below it, or build the model with more start signals.")
    return signal_ids.long()


def check_labels(labels, input_ids):
    """Labels must have the ids' shape (their values are checked where they are shifted: `losses.shift_labels`)."""
    if labels.shape != input_ids.shape:
        raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)}, got "
                         f"{tuple(labels.shape)}.")
