"""Convert a released BriLLM0.5 checkpoint into a Hugging Face folder (docs/model.md, "Checkpoint formats").

    python -m modeling_brillm.convert_brillm05 --checkpoint model.bin --vocab vocab.json \
        [--word-frequency word_frequency.json] [--tokenizer tokenizer.json] --output-dir DIR

The release's rows are already in this package's order, so the memory-mapped tensors go straight to safetensors.
Without a frequency file the graph is dense; with one, a pair listed with count 0 is shared, every other is real.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

from .configuration_brillm import BriLLMConfig
from .graph import BigramGraph
from .modeling_brillm import BriLLMForCausalLM

RELEASED_TENSORS = ("node_bias", "weights", "biases", "positions")


class ConversionError(ValueError):
    """The released files are missing, malformed or disagree with each other."""


def _read_json(path, what):
    path = Path(path)
    if not path.is_file():
        raise ConversionError(f"{what} file not found: {path}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ConversionError(f"{what} file {path} is not valid JSON: {error}") from error


def load_released_state_dict(checkpoint) -> dict[str, torch.Tensor]:
    """The four released tensors, memory-mapped (weights_only: a checkpoint cannot run code)."""
    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise ConversionError(f"checkpoint not found: {checkpoint}")
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:  # torch raises many kinds here: say which file and why
        raise ConversionError(f"cannot read {checkpoint} as a torch.save state dict ({error}).") from error
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    state = {key.removeprefix("module."): value for key, value in state.items()}
    missing = [name for name in RELEASED_TENSORS if name not in state]
    if missing:
        raise ConversionError(f"{checkpoint} is not a BriLLM0.5 checkpoint: missing {missing} (found "
                              f"{sorted(state)[:8]}).")
    return {name: state[name] for name in RELEASED_TENSORS}


def _vocab_index(vocab, token, what) -> int:
    if token not in vocab:
        raise ConversionError(f"word-frequency {what} token {token!r} is not in the vocab file.")
    return vocab[token]


def released_graph(vocab: dict[str, int], word_frequency: dict | None) -> BigramGraph | None:
    """The real edges of a release: every pair except those listed with count 0 (None = dense)."""
    if word_frequency is None:
        return None
    V = len(vocab)
    real = torch.ones(V, V, dtype=torch.bool)
    counts = torch.zeros(V, V, dtype=torch.long)
    for source, targets in word_frequency.items():
        u = _vocab_index(vocab, source, "source")
        for target, count in targets.items():
            v = _vocab_index(vocab, target, "target")
            real[u, v], counts[u, v] = count != 0, int(count)
    indptr = torch.cat([torch.zeros(1, dtype=torch.long), real.sum(1).cumsum(0)])
    return BigramGraph(indptr=indptr, indices=real.nonzero()[:, 1].contiguous(), counts=counts[real])


def convert(checkpoint, vocab_file, output_dir, word_frequency_file=None, tokenizer_file=None) -> BriLLMForCausalLM:
    """Write a HF folder (safetensors, config with auto_map, remote code, tokenizer when known) and return the model."""
    vocab = _read_json(vocab_file, "vocab")
    if not isinstance(vocab, dict) or not all(isinstance(i, int) for i in vocab.values()):
        raise ConversionError(f"vocab file {vocab_file} must map token -> index.")
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise ConversionError(f"vocab file {vocab_file} must number its {len(vocab)} tokens 0..{len(vocab) - 1}.")
    state = load_released_state_dict(checkpoint)
    V, _, d = state["node_bias"].shape
    if V != len(vocab):
        raise ConversionError(f"checkpoint has {V} nodes but the vocab file lists {len(vocab)} tokens.")
    frequency = _read_json(word_frequency_file, "word-frequency") if word_frequency_file else None
    graph = released_graph(vocab, frequency)
    rows = state["weights"].shape[0]
    expected = (graph.num_edges if graph is not None else V * V) + 1
    if rows != expected:
        hint = "pass the word-frequency file it was trained with" if graph is None else "check the word-frequency file"
        raise ConversionError(f"checkpoint has {rows} edge rows but the {'dense' if graph is None else 'sparse'} "
                              f"graph needs {expected} (real edges + shared): {hint}.")
    tokenizer = _released_tokenizer(tokenizer_file, vocab_file, vocab)
    special = {} if tokenizer is None else {
        f"{name}_token_id": getattr(tokenizer, f"{name}_token_id") for name in ("bos", "eos", "pad", "unk")}
    config = BriLLMConfig(vocab_size=V, node_size=d, max_position_embeddings=state["positions"].shape[1],
                          graph="dense" if graph is None else "sparse",
                          num_edges=None if graph is None else graph.num_edges, **special)
    with torch.device("meta"):  # no allocation: the mmapped tensors become the parameters
        model = BriLLMForCausalLM(config)
    tensors = dict(state)
    if graph is not None:
        tensors.update(graph_indptr=graph.indptr, graph_indices=graph.indices, graph_counts=graph.counts)
    model.base_model.load_state_dict(tensors, assign=True, strict=True)
    model.check_graph()
    model.save_pretrained(output_dir)
    if tokenizer is not None:
        tokenizer.model_max_length = config.max_position_embeddings  # what pipelines and harnesses truncate to
        tokenizer.save_pretrained(output_dir)
    return model


def _released_tokenizer(tokenizer_file, vocab_file, vocab):
    """The English BPE tokenizer when given; a character tokenizer for a character vocab (the Chinese release)."""
    from tokenization import load_released_char_vocab, load_released_tokenizer
    if tokenizer_file:
        tokenizer = load_released_tokenizer(tokenizer_file)
        mismatched = [t for t, i in vocab.items() if tokenizer.convert_tokens_to_ids(t) != i]
        if mismatched:
            raise ConversionError(f"tokenizer {tokenizer_file} numbers {len(mismatched)} vocab tokens differently "
                                  f"from {vocab_file} (e.g. {mismatched[:3]}): use the tokenizer the checkpoint was "
                                  "trained with.")
        return tokenizer
    if all(len(token) == 1 or token.startswith("<") for token in vocab):
        return load_released_char_vocab(vocab_file)
    return None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="released torch.save state dict (.bin)")
    parser.add_argument("--vocab", required=True, help="vocab JSON: token -> node index")
    parser.add_argument("--word-frequency", help="word_frequency JSON of a sparse release (omit for dense)")
    parser.add_argument("--tokenizer", help="released tokenizers JSON (English)")
    parser.add_argument("--output-dir", required=True)
    args = parser.parse_args(argv)
    try:
        model = convert(args.checkpoint, args.vocab, args.output_dir, args.word_frequency, args.tokenizer)
    except ConversionError as error:
        parser.exit(2, f"error: {error}\n")
    config = model.config
    print(f"wrote {os.path.abspath(args.output_dir)}: {config.graph} graph, V={config.vocab_size}, d={config.node_size}"
          f", {config.num_edges} real edges, {config.num_parameters_formula() / 1e9:.3f}B parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
