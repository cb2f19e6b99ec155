"""Fast built-in perplexity of a BriLLM, from the model's own exact loss over all V nodes (without building the
(batch, length, V) logits; a model configured with the release's sampled loss is scored with the exact loss, a
sampled loss being no likelihood). Perplexity here is token-weighted over the whole corpus, exp(total NLL / predicted
tokens), every token of a text but the first predicted (the tokenizer's BOS is prepended when it adds one); the
`evaluate` metric instead averages per-text perplexities (`per_text_perplexity`, `examples/perplexity.py`). This
module imports nothing beyond torch (datasets are used duck-typed)."""

import math
import os
from dataclasses import dataclass

import torch

__all__ = ["PerplexityResult", "perplexity", "per_text_perplexity", "load_texts"]


@dataclass
class PerplexityResult:
    perplexity: float  # exp(nll)
    nll: float  # mean negative log-likelihood per predicted token (nats)
    num_tokens: int  # predicted tokens
    num_sequences: int  # texts (or id sequences) read
    num_blocks: int  # blocks scored (texts longer than block_size give several)
    block_size: int


def load_texts(data, text_column: str = "text") -> list:
    """Texts (str) or token-id sequences from: a list of strings, a file path (one text per non-empty line), a
    single string that is not a file, a `datasets.Dataset` / `IterableDataset` (its `text_column`, or its
    `input_ids`), a list of id lists / 1-D tensors, or a 2-D tensor (one sequence per row)."""
    if isinstance(data, os.PathLike) or (isinstance(data, str) and "\n" not in data and os.path.isfile(data)):
        with open(os.fspath(data), encoding="utf-8") as f:
            return [line.rstrip("\r\n") for line in f if line.strip()]
    if isinstance(data, str) and looks_like_a_path(data):
        raise FileNotFoundError(f"{data}: no such file (to score this string as a text, pass it in a list: "
                                f"perplexity(model, tokenizer, [{data!r}])).")
    if isinstance(data, str):
        return [data]
    if isinstance(data, torch.Tensor):
        if data.dim() in (1, 2):
            return list(data if data.dim() == 2 else data.unsqueeze(0))
        raise ValueError(f"a tensor of token ids must be 1-D or 2-D, got shape {tuple(data.shape)}.")
    column_names = getattr(data, "column_names", None)
    if column_names is not None:  # a datasets.Dataset / IterableDataset (duck-typed)
        if isinstance(column_names, dict):  # DatasetDict
            raise ValueError(f"pick a split of the DatasetDict first (one of {list(column_names)}).")
        for column in (text_column, "input_ids"):
            if column in column_names:
                return [row[column] for row in data]
        raise ValueError(f"the dataset has no {text_column!r} column (columns: {list(column_names)}); "
                         "pass text_column=...")
    try:
        return list(data)
    except TypeError:
        raise TypeError(f"cannot read texts from a {type(data).__name__}: give a list of strings, a file path, "
                        "a datasets.Dataset, or token ids.") from None


def looks_like_a_path(text: str) -> bool:
    """One word with a folder separator or a text file's extension: a path, not a text to score."""
    return not any(c.isspace() for c in text) and (os.sep in text or "/" in text or os.path.splitext(text)[1].lower()
                                                   in (".txt", ".text", ".json", ".jsonl", ".csv"))


def _encode(items, tokenizer, add_eos: bool) -> list[torch.Tensor]:
    texts = [i for i in items if isinstance(i, str)]
    if texts and len(texts) != len(items):
        raise TypeError("mix of texts and token ids: give one kind.")
    if texts:
        if tokenizer is None:
            raise ValueError("texts need a tokenizer: perplexity(model, tokenizer, texts) (or pass token ids).")
        keep = [t for t in texts if t.strip()]
        if not keep:
            return []
        if add_eos and tokenizer.eos_token_id is None:
            raise ValueError("add_eos=True but the tokenizer has no eos token.")
        eos = [tokenizer.eos_token_id] if add_eos else []
        encoded = tokenizer(keep)["input_ids"]
        return [torch.tensor(list(e) + eos, dtype=torch.long) for e in encoded]
    seqs = []
    for item in items:
        ids = torch.as_tensor(item)
        if ids.is_floating_point() or ids.dtype == torch.bool:
            raise TypeError(f"token ids must be integers, got dtype {ids.dtype}.")
        seqs.append(ids.reshape(-1).long())
    return seqs


@torch.no_grad()
def perplexity(model, tokenizer=None, data=None, block_size: int | None = None, batch_size: int = 16,
               text_column: str = "text", add_eos: bool = False, device=None) -> PerplexityResult:
    """Token-weighted perplexity of `model` on `data` (texts with `tokenizer`, token ids with `tokenizer=None`; the
    forms of `load_texts`). Texts longer than `block_size` (default `config.max_position_embeddings`, at least 2) are
    cut into consecutive blocks, each scored on its own (its first token context only); a model with
    `config.position_overflow="extend"` takes any `block_size`, 0 scoring every text whole. `batch_size`: blocks per
    forward pass (sorted by length); `add_eos`: append the tokenizer's EOS to every text (score its end too)."""
    if data is None:
        raise ValueError("perplexity needs data: a list of texts, a file path, a dataset, or token ids.")
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}.")
    config = model.config
    block_size, whole = _block_size(config, block_size)
    sequences = _encode(load_texts(data, text_column), tokenizer, add_eos)
    V = int(config.vocab_size)
    for seq in sequences:
        if seq.numel() and (int(seq.min()) < 0 or int(seq.max()) >= V):
            bad = int(seq.min()) if int(seq.min()) < 0 else int(seq.max())
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {V}) of this model.")
    blocks = [b for seq in sequences for b in ([seq] if whole else seq.split(block_size)) if b.numel() >= 2]
    if whole:
        block_size = max((b.numel() for b in blocks), default=0)  # reported: the longest block scored
    num_tokens = sum(b.numel() - 1 for b in blocks)
    if num_tokens == 0:
        raise ValueError("nothing to score: every text is empty or a single token (perplexity needs at least two "
                         "tokens in a text, e.g. BOS plus one).")
    blocks.sort(key=lambda b: -b.numel())
    device = torch.device(device) if device is not None else getattr(model, "device", torch.device("cpu"))
    nll = _summed_nll(model, blocks, batch_size, device) / num_tokens
    return PerplexityResult(perplexity=math.exp(nll), nll=nll, num_tokens=num_tokens, num_sequences=len(sequences),
                            num_blocks=len(blocks), block_size=block_size)


def _block_size(config, block_size: int | None) -> tuple[int, bool]:
    """(the block size, whether every text is scored whole), checked against the model's range."""
    max_positions = int(config.max_position_embeddings)
    extends = getattr(config, "position_overflow", "error") == "extend"
    block_size = max_positions if block_size is None else int(block_size)
    whole = extends and block_size == 0  # one block per text, however long
    if not whole and block_size < 2:
        raise ValueError(f"block_size must be at least 2, got {block_size}"
                         + (" (0 scores every text whole)." if extends else "."))
    if not extends and block_size > max_positions:
        raise ValueError(f"block_size={block_size} is beyond max_position_embeddings={max_positions} of this model; "
                         f"use at most {max_positions}, or set model.config.position_overflow=\"extend\" to read "
                         "past the trained range (the last position weight is reused there).")
    return block_size, whole


def _summed_nll(model, blocks, batch_size: int, device) -> float:
    """The exact loss's summed NLL over the blocks' next tokens (the model in eval mode, its loss type exact)."""
    config = model.config
    pad_id = getattr(config, "pad_token_id", None) or 0
    was_training, loss_type = model.training, getattr(config, "loss_type", "exact")
    model.eval()
    total = torch.zeros((), dtype=torch.float64)
    try:
        config.loss_type = "exact"
        for start in range(0, len(blocks), batch_size):
            batch = blocks[start:start + batch_size]
            lengths = torch.tensor([b.numel() for b in batch])
            ids = torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=pad_id)
            mask = (torch.arange(ids.shape[1]) < lengths.unsqueeze(1)).long()
            labels = ids.masked_fill(mask == 0, -100)
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            out = model(ids, attention_mask=None if bool(mask.all()) else mask, labels=labels, use_cache=False,
                        return_logits=False)
            total += out.loss.double().cpu() * int((lengths - 1).sum())
    finally:
        config.loss_type = loss_type
        model.train(was_training)
    return float(total)


@torch.no_grad()
def per_text_perplexity(model, tokenizer, texts, batch_size: int = 16, add_start_token: bool = True,
                        max_length: int | None = None, device=None) -> dict:
    """The `evaluate` "perplexity" metric's numbers (per-text perplexities and their plain mean) by the metric's own
    steps, in-process: for where the metric's script cannot be downloaded."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if not texts:
        raise ValueError("no texts to score.")
    if tokenizer.pad_token is None and batch_size > 1:
        specials = list(tokenizer.all_special_tokens)
        if not specials:
            raise ValueError("the tokenizer has neither a pad token nor any special token to pad with.")
        tokenizer.add_special_tokens({"pad_token": specials[0]})
    if add_start_token and tokenizer.bos_token is None:
        raise ValueError("add_start_token=True needs a tokenizer with a bos token.")
    max_tokenized_len = max_length - 1 if (add_start_token and max_length) else max_length
    encodings = tokenizer(texts, add_special_tokens=False, padding=True, truncation=bool(max_tokenized_len),
                          max_length=max_tokenized_len, return_tensors="pt", return_attention_mask=True)
    encoded, masks = encodings["input_ids"], encodings["attention_mask"]
    need = 1 if add_start_token else 2
    if bool((masks.sum(1) < need).any()):
        raise ValueError(f"every text needs at least {need} token(s) (with add_start_token={add_start_token}).")
    if add_start_token:
        bos = torch.full((encoded.shape[0], 1), tokenizer.bos_token_id, dtype=encoded.dtype)
        encoded, masks = torch.cat([bos, encoded], 1), torch.cat([torch.ones_like(bos), masks], 1)
    device = torch.device(device) if device is not None else getattr(model, "device", torch.device("cpu"))
    loss_fct = torch.nn.CrossEntropyLoss(reduction="none")
    ppls = []
    for start in range(0, len(encoded), batch_size):
        batch, mask = encoded[start:start + batch_size], masks[start:start + batch_size]
        logits = model(batch.to(device), attention_mask=mask.to(device)).logits.float().cpu()
        shift_logits, shift_labels, shift_mask = logits[:, :-1], batch[:, 1:], mask[:, 1:]
        nll = (loss_fct(shift_logits.transpose(1, 2), shift_labels) * shift_mask).sum(1) / shift_mask.sum(1)
        ppls += torch.exp(nll).tolist()
    return {"perplexities": ppls, "mean_perplexity": float(sum(ppls) / len(ppls))}
