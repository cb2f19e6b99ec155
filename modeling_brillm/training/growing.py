"""Growing a trained BriLLM without retraining it, in five checked steps (examples/grow_graph.py, docs/training.md)."""

import argparse
import json
import math
import re
import sys
from collections import Counter
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM

from modeling_brillm import BriLLMForCausalLM
from modeling_brillm.graph_editing import NODE_ROWS

from .data import embedded_corpus, split_sentences
from .errors import UsageError, load_model, load_tokenizer
from .finetuning import pad_batch, split_records


def parse_args(argv=None):  # a flag list: exempt from the function length
    p = argparse.ArgumentParser(description="Grow a trained BriLLM: add tokens (nodes) and edges, then fine-tune "
                                "only what is new.")
    p.add_argument("--model", required=True, help="a saved BriLLM folder (model + tokenizer), e.g. outputs/demo")
    p.add_argument("--output_dir", help="where to save the grown model (default: <model>-grown)")
    p.add_argument("--new_text", help="file, one text per line (default: examples/grow_graph_text.txt)")
    p.add_argument("--old_text", help="held-out text of the original domain, one text per line (default: the demo "
                                      "validation split of the built-in corpus)")
    p.add_argument("--old_train_text", help="old training text for the replay, one text per line (default: the "
                                            "built-in corpus's training split when --old_text is not given)")
    p.add_argument("--replay", type=int, default=256, help="old training texts per fine-tune step (0 = none)")
    p.add_argument("--add_tokens", nargs="*", help="tokens to add (default: picked from the new text)")
    p.add_argument("--num_new_tokens", type=int, default=12)
    p.add_argument("--train", choices=["new", "all"], default="new", help="which parameters the fine-tune updates")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--max_length", type=int, default=32, help="tokens per text (as the demo's training blocks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the figures here")
    return p.parse_args(argv)


def main(argv=None, default_new_text=None) -> dict:
    """The five steps' figures (also to --json); `default_new_text`: read without --new_text. Bad input: exit 2."""
    args = parse_args(argv)
    args.new_text = args.new_text or default_new_text
    try:
        if args.new_text is None:
            raise UsageError("give --new_text FILE (one text per line).")
        torch.manual_seed(args.seed)
        model, tokenizer = load_model(args.model, BriLLMForCausalLM).eval(), load_tokenizer(args.model)
        return grow(args, model, tokenizer)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def grow(args, model, tokenizer) -> dict:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    old_vocab, old_edges = model.config.vocab_size, model.config.num_edges
    texts = load_texts(args, tokenizer, pad_id)
    probe_before, ppl_old_before = logits_of(model, *texts.probe), perplexity(model, texts.old_seqs, pad_id)[0]
    nodes = add_nodes(args, model, tokenizer, texts, probe_before)  # 1. nodes
    grown = add_edges(args, model, tokenizer, texts, pad_id, nodes["probe"])  # 2. edges
    before = {**measure(model, grown, texts, pad_id, nodes["new_ids"]), "old_held": ppl_old_before}
    tuned = fine_tune_new(args, model, texts, grown, pad_id, old_vocab)  # 3. fine-tune
    after = measure(model, grown, texts, pad_id, nodes["new_ids"])  # 4. measure
    result = {
        "new_tokens": nodes["new_tokens"], "vocab": [old_vocab, model.config.vocab_size],
        "edges": [old_edges, model.config.num_edges], "nodes_exact": nodes["nodes_exact"],
        "edges_exact": grown["edges_exact"], "edges_max_diff": grown["edges_diff"],
        "edges_same_argmax": grown["same_argmax"], "train": args.train, "steps": args.steps,
        "loss": [tuned["losses"][0], tuned["losses"][-1]], "old_rows_unchanged": tuned["old_rows_unchanged"],
        **{f"ppl_{key}": [before[key], after[key]] for key in before},
        "old_change": after["old_held"] / before["old_held"] - 1}
    report(args, result, nodes["added"], grown, texts)
    result.update(save_and_reload(args, model, tokenizer, grown["held_seqs"], pad_id))  # 5. save, reload
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


# ---------------------------------------------------------------------------------------------------- text
def read_lines(path):
    try:
        with open(path, encoding="utf-8") as f:
            return [line.strip() for line in f if line.strip()]
    except OSError as err:
        raise UsageError(f"{path}: {err.strerror.lower()}.") from None


def builtin_old_text():
    """The demo's (validation, training) sentences: every 20th paragraph of the built-in corpus, and the rest."""
    training, validation = split_records(embedded_corpus(), 5)
    return [s for p in validation for s in split_sentences(p)], [s for p in training for s in split_sentences(p)]


def load_texts(args, tokenizer, pad_id):
    """The new text (every 4th line held out); the old text, tokenized before the tokenizer grows, and a probe of it."""
    new = read_lines(args.new_text)
    if args.old_text:
        old, old_train = read_lines(args.old_text), read_lines(args.old_train_text) if args.old_train_text else []
    else:
        old, old_train = builtin_old_text()
    old_seqs = encode(tokenizer, old, args.max_length)
    replay = encode(tokenizer, old_train, args.max_length) if args.replay else []
    new_train, new_held = split_records(new, 25)
    return SimpleNamespace(new=new, new_train=new_train, new_held=new_held, old=old, old_train=old_train,
                           old_seqs=old_seqs, replay=replay, probe=pad_batch(old_seqs[:32], pad_id))


def pick_new_tokens(tokenizer, texts, count, old_texts):
    """The most frequent words of the new text that the tokenizer splits and old text never uses."""
    old_words = {w for t in old_texts for w in re.findall(r"[a-z]+", t.lower())}
    words = Counter(w for t in texts for w in re.findall(r"[A-Za-z]{5,}", t.lower()))
    split = [w for w, _ in words.most_common()
             if w not in old_words and len(tokenizer(w, add_special_tokens=False).input_ids) >= 2]
    return split[:count]


def encode(tokenizer, texts, max_length):
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    seqs = [tokenizer(text).input_ids[: max_length - 1] + eos for text in texts]
    return [torch.tensor(ids) for ids in seqs if len(ids) >= 2]


@torch.no_grad()
def logits_of(model, ids, mask):
    return model(ids, attention_mask=mask).logits


@torch.no_grad()
def perplexity(model, seqs, pad_id, focus=None, batch_size=64):
    """exp(mean NLL) over every next token, and over the next tokens whose id is in `focus` (or None)."""
    total = count = focus_total = focus_count = 0.0
    focus_t = torch.tensor(sorted(focus or ()), dtype=torch.long)
    for i in range(0, len(seqs), batch_size):
        ids, mask = pad_batch(seqs[i:i + batch_size], pad_id)
        logp = torch.log_softmax(model(ids, attention_mask=mask).logits[:, :-1], -1)
        target, real = ids[:, 1:], mask[:, 1:].bool()
        nll = -logp.gather(2, target.unsqueeze(2)).squeeze(2)
        hit = real & torch.isin(target, focus_t)
        total, count = total + float(nll[real].sum()), count + int(real.sum())
        focus_total, focus_count = focus_total + float(nll[hit].sum()), focus_count + int(hit.sum())
    return math.exp(total / count), (math.exp(focus_total / focus_count) if focus_count else None)


# ---------------------------------------------------------------------------------------------------- steps
def add_nodes(args, model, tokenizer, texts, probe_before) -> dict:
    """Step 1: new tokens become new nodes; the old nodes' logits must not move."""
    old_vocab = model.config.vocab_size
    new_tokens = args.add_tokens or pick_new_tokens(tokenizer, texts.new, args.num_new_tokens,
                                                    texts.old + texts.old_train)
    added = tokenizer.add_tokens(new_tokens)
    model.resize_token_embeddings(len(tokenizer))
    probe = logits_of(model, *texts.probe)
    return {"new_tokens": new_tokens, "added": added, "new_ids": set(range(old_vocab, len(tokenizer))),
            "probe": probe, "nodes_exact": torch.equal(probe[..., :old_vocab], probe_before)}


def add_edges(args, model, tokenizer, texts, pad_id, probe_nodes) -> dict:
    """Step 2: the new text's bigrams become real edges (copies of the shared edge): no energy may move, except that
    with `non_edge_bias` a new pair u→v no longer adds v's non-successor offset."""
    train_seqs = encode(tokenizer, texts.new_train, args.max_length)
    rows = model.add_edges_from_sequences(train_seqs, ignore_ids=[pad_id])
    probe = logits_of(model, *texts.probe)
    expected = probe_nodes - lost_offsets(model, rows, texts.probe[0])
    return {"rows": rows, "train_seqs": train_seqs, "held_seqs": encode(tokenizer, texts.new_held, args.max_length),
            "edges_exact": bool(torch.allclose(probe, expected, rtol=0, atol=1e-5)),
            "edges_diff": float((probe - expected).abs().max()),
            "same_argmax": bool(torch.equal(probe.argmax(-1), probe_nodes.argmax(-1)))}


def lost_offsets(model, rows, ids) -> torch.Tensor | float:
    """(B, T, V) the non-successor offset each new edge's pair had before it became an edge (0 elsewhere)."""
    bias = model.base_model.non_edge_bias
    if bias is None or len(rows) == 0:
        return 0.0
    graph = model.get_graph()
    edges = rows - 1  # edge-table row r is edge r - 1 in the graph's CSR order
    sources, targets = torch.searchsorted(graph.indptr, edges, right=True) - 1, graph.indices[edges]
    hit = (ids.unsqueeze(-1) == sources).float()  # (B, T, new edges): the position's node is the edge's source
    offsets = torch.zeros(*ids.shape, model.config.vocab_size)
    return offsets.scatter_add_(-1, targets.expand_as(hit), hit * bias.detach()[targets])


def new_rows(model, edge_rows, old_vocab: int) -> dict:
    """Parameter name -> True for its rows that growing added (the new edges' table rows, the new nodes' rows)."""
    nodes = slice(old_vocab, None)
    rows = {"weights": edge_rows, "biases": edge_rows, "node_bias": nodes, **{name: nodes for name in NODE_ROWS}}
    masks = {name: torch.zeros(param.shape[0], dtype=torch.bool, device=param.device)
             for name, param in model.base_model.named_parameters() if name in rows}
    for name, mask in masks.items():
        mask[rows[name]] = True
    return masks


def fine_tune_new(args, model, texts, grown, pad_id, old_vocab) -> dict:
    """Step 3: AdamW on the new text (and `--replay` old lines a step); with --train new only the rows growing added
    get gradients, and weight decay 0 and Adam's zero moments leave every old row as it was (checked)."""
    params = dict(model.base_model.named_parameters())
    masks = new_rows(model, grown["rows"], old_vocab)
    old = {name: ~masks[name] if name in masks else slice(None) for name in params}  # each parameter's old rows
    before = {name: p.detach()[old[name]].clone() for name, p in params.items()}
    trained = params if args.train == "all" else {name: params[name] for name in masks}
    optimizer, losses = torch.optim.AdamW(trained.values(), lr=args.lr, weight_decay=0.0), []
    model.train()
    for _ in range(args.steps):
        replay = [texts.replay[i] for i in torch.randperm(len(texts.replay))[:args.replay].tolist()]
        ids, mask = pad_batch(list(grown["train_seqs"]) + replay, pad_id)
        loss = model(ids, attention_mask=mask, labels=ids, return_logits=False).loss
        optimizer.zero_grad()
        loss.backward()
        for name in masks if args.train != "all" else ():
            params[name].grad[old[name]] = 0
        optimizer.step()
        losses.append(float(loss.detach()))
    model.eval()
    unchanged = all(torch.equal(p.detach()[old[name]], before[name]) for name, p in params.items())
    return {"losses": losses, "old_rows_unchanged": unchanged}


def measure(model, grown, texts, pad_id, new_ids) -> dict:
    """Step 4: perplexity of the held-out new text (and of its new tokens), its training lines, the old text."""
    new, focus = perplexity(model, grown["held_seqs"], pad_id, new_ids)
    return {"new_held": new, "new_tokens_held": focus, "new_train": perplexity(model, grown["train_seqs"], pad_id)[0],
            "old_held": perplexity(model, texts.old_seqs, pad_id)[0]}


def save_and_reload(args, model, tokenizer, held_seqs, pad_id) -> dict:
    """Step 5: save; reload with the package class and as remote code; the logits must be the same."""
    output_dir = args.output_dir or args.model.rstrip("/") + "-grown"
    model.save_pretrained(output_dir)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(output_dir)
    ids, mask = pad_batch(held_seqs, pad_id)
    expected = logits_of(model, ids, mask)
    reload_ok = torch.equal(logits_of(BriLLMForCausalLM.from_pretrained(output_dir).eval(), ids, mask), expected)
    remote = AutoModelForCausalLM.from_pretrained(output_dir, trust_remote_code=True).eval()
    remote_ok = torch.equal(logits_of(remote, ids, mask), expected)
    print(f"saved to {output_dir}; BriLLMForCausalLM.from_pretrained gives the same logits: {reload_ok}; "
          f"AutoModelForCausalLM.from_pretrained(trust_remote_code=True) too: {remote_ok}")
    return {"reload_ok": reload_ok, "remote_ok": remote_ok, "output_dir": output_dir}


def report(args, r: dict, added: int, grown: dict, texts):
    """The lines the run prints about steps 1-4, from their figures `r`."""
    print(f"added {added} tokens ({', '.join(r['new_tokens'])}): V {r['vocab'][0]} -> {r['vocab'][1]}; "
          f"{len(grown['rows'])} edges: {r['edges'][0]:,} -> {r['edges'][1]:,} real edges")
    print(f"old nodes' logits unchanged after adding nodes: {r['nodes_exact']}; after adding edges: logits equal "
          f"{r['edges_exact']} (largest difference {r['edges_max_diff']:.2e}), greedy predictions equal "
          f"{r['edges_same_argmax']}")
    print(f"fine-tune ({args.train} parameters, {args.steps} steps of AdamW lr {args.lr} on {len(grown['train_seqs'])}"
          f" new lines + {min(args.replay, len(texts.replay))} old ones per step): loss {r['loss'][0]:.3f} -> "
          f"{r['loss'][1]:.3f}; old rows unchanged: {r['old_rows_unchanged']}")
    new, focus, train, old = (r[f"ppl_{key}"] for key in ("new_held", "new_tokens_held", "new_train", "old_held"))
    print(f"new text, held out ({len(grown['held_seqs'])} lines): perplexity {new[0]:.1f} -> {new[1]:.1f}")
    if focus[0] is not None:
        print(f"new tokens as targets, held out: perplexity {focus[0]:.1f} -> {focus[1]:.1f}")
    print(f"new text, training lines: perplexity {train[0]:.1f} -> {train[1]:.1f}")
    print(f"old text, held out ({len(texts.old_seqs)} texts): perplexity {old[0]:.3f} -> {old[1]:.3f} "
          f"({100 * r['old_change']:+.2f}%)")
