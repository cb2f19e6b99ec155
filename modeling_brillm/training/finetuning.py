"""Fine-tuning a saved BriLLM on prompt/completion data, the loss on the completion only (`run`: examples/finetune.py;
docs/training.md). Frozen parameters stay bit for bit as they were; the output folder is the run's own."""

import argparse
import itertools
import json
import math
import os
import re
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import torch
from torch.utils.data import DataLoader
from transformers import get_scheduler

from modeling_brillm import BriLLMConfig, BriLLMForCausalLM
from modeling_brillm.model_card import write_model_card

from .arguments import positive
from .checkpoints import open_folder, write_json
from .data import held_out_indices
from .errors import UsageError, load_model, load_tokenizer, run_cli
from .launch import make_accelerator
from .loop import TrainStep, evaluate
from .optimizers import build_optimizer, choose_optimizer

# Peak learning rates by what is trained (--learning_rate overrides): a few d-numbers move far less per step than
# the whole graph, so the small parameter sets get larger steps.
DEFAULT_LR = {"all": 1e-2, "touched_edges": 1e-2, "node_bias": 5e-2, "start_signal": 1e-1}
TRAIN_ONLY = tuple(DEFAULT_LR)
RESULTS_NAME = "finetune_results.json"
HOW = {"node_bias": "Only the node biases were trained.",
       "touched_edges": "Only the edges the fine-tuning data crosses were trained.",
       "all": "Every parameter was trained.",
       "start_signal": "Only the learned start signal was trained (prompt tuning, d numbers per task){signal}"}


def parse_args(argv=None) -> argparse.Namespace:  # a flag list: exempt from the function length
    p = argparse.ArgumentParser(description="Fine-tune a saved (or converted) BriLLM model on prompt/completion "
                                "data, with the loss on the completion only.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model_name_or_path", required=True, help="A saved or converted BriLLM folder (or Hub id).")
    p.add_argument("--tokenizer_name", help="Its tokenizer, if not saved beside the model.")
    p.add_argument("--train_file", help=".jsonl/.json prompt/completion (or text) records, or .txt plain text; "
                   "none: the built-in topic/summary pairs.")
    p.add_argument("--validation_file", help="Held-out records, same formats; none: a split of the training data.")
    p.add_argument("--validation_split_percentage", type=float, default=20.0, help="Records held out without one.")
    p.add_argument("--train_only", default="all", help=f"What to train: {', '.join(TRAIN_ONLY)}.")
    p.add_argument("--signal_id", type=int, default=0, help="The start signal of records without a signal_id.")
    p.add_argument("--max_length", type=int, help="Tokens per sequence. [the model's max_position_embeddings]")
    p.add_argument("--per_device_train_batch_size", type=int, default=16)
    p.add_argument("--per_device_eval_batch_size", type=int, default=32)
    p.add_argument("--learning_rate", type=float,
                   help="Peak learning rate. [" + ", ".join(f"{k}: {v:g}" for k, v in DEFAULT_LR.items()) + "]")
    p.add_argument("--weight_decay", type=float, default=0.0, help="AdamW weight decay on edge matrices.")
    p.add_argument("--num_train_epochs", type=int, default=10)
    p.add_argument("--max_train_steps", type=int, help="Optimizer steps; overrides epochs.")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr_scheduler_type", default="linear", help="A transformers scheduler name.")
    p.add_argument("--num_warmup_steps", type=int, default=0)
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="Clip the gradient norm (0: off).")
    p.add_argument("--optimizer", default="adamw", help="adamw, or sparse_adamw (sparse edge-row gradients).")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--torch_threads", type=int, help="torch CPU threads.")
    p.add_argument("--num_samples", type=int, default=3, help="Validation prompts completed before and after.")
    p.add_argument("--max_new_tokens", type=int, default=32, help="Tokens per sample completion.")
    p.add_argument("--logging_steps", type=int, default=10, help="Print the loss every N optimizer steps.")
    p.add_argument("--output_dir", default="outputs/finetune", help="Where the fine-tuned folder goes.")
    p.add_argument("--overwrite_output_dir", action="store_true", help="Replace the model in --output_dir (once the "
                   "new one is saved).")
    p.add_argument("--with_tracking", action="store_true", help="Log to experiment trackers (--report_to).")
    p.add_argument("--report_to", default="all", help="Trackers: tensorboard, wandb, ... or 'all'.")
    p.add_argument("--no_malloc_tuning", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def check_args(args):
    if args.train_only not in TRAIN_ONLY:
        raise UsageError(f"--train_only {args.train_only!r} is unknown: choose one of {', '.join(TRAIN_ONLY)}.")
    for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "num_train_epochs",
                 "gradient_accumulation_steps", "logging_steps", "max_train_steps"):
        if getattr(args, name) is not None:
            positive(name, getattr(args, name))
    if args.max_length is not None and args.max_length < 2:
        raise UsageError("--max_length must be at least 2 (a prompt token and a completion token).")
    if args.signal_id < 0:
        raise UsageError(f"--signal_id must be a non-negative integer, got {args.signal_id}.")
    if args.learning_rate is not None and not args.learning_rate > 0:
        raise UsageError(f"--learning_rate must be positive, got {args.learning_rate}.")
    if not 0 <= args.validation_split_percentage < 100:
        raise UsageError("--validation_split_percentage must be in [0, 100).")
    if args.validation_file and not args.train_file:
        raise UsageError("--validation_file needs --train_file too (the built-in set has its own split).")
    if args.train_only == "touched_edges" and args.optimizer == "adamw" and args.weight_decay > 0:
        raise UsageError("--train_only touched_edges with --optimizer adamw needs --weight_decay 0 (AdamW would decay "
                         "every edge matrix); use --optimizer sparse_adamw, which decays the touched rows only.")


def run(args) -> int:
    """The whole job: data and model, completions and perplexity before, training, after, the saved folder."""
    check_args(args)
    accelerator, setup_line = make_accelerator(args)
    say = accelerator.print
    say(f"fine-tuning: {setup_line}")
    with open_folder(args.output_dir, accelerator, args.overwrite_output_dir, resumable=False) as folder:
        data = load_everything(args, accelerator)
        sample_records = [r for r in data.val_records if "prompt" in r][: args.num_samples]
        samples_before = complete(data.model, data.tokenizer, sample_records, args) if accelerator.is_main_process \
            else []
        job = prepare_training(args, data, accelerator)

        before = evaluate_completions(job.model, job.val_loader, accelerator)
        say(f"before: completion perplexity {before['perplexity']:,.2f} (loss {before['loss']:.4f}, "
            f"{before['tokens']:,} completion tokens)")
        completed, losses, seconds = train(args, data, job, accelerator)
        after = evaluate_completions(job.model, job.val_loader, accelerator)
        say(f"after: completion perplexity {after['perplexity']:,.2f} (loss {after['loss']:.4f}); before "
            f"{before['perplexity']:,.2f}; {completed} steps in {seconds:.1f}s")

        samples = compare_samples(args, data, job, sample_records, samples_before, accelerator)
        results = {"base_model": args.model_name_or_path, "train_only": args.train_only,
                   "trainable_parameters": job.trainable, "total_parameters": job.total,
                   "signal_id": args.signal_id if data.learned else None, "learning_rate": job.lr, "steps": completed,
                   "train_seconds": round(seconds, 2), "train_sequences": len(data.train_rows),
                   "validation_sequences": len(data.val_rows), "before": before, "after": after,
                   "final_train_loss": losses[-1] if losses else None, "samples": samples}
        save_folder(accelerator, job.model, data.tokenizer, folder, results, data.line)
        say(f"saved to {folder.path} (AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True))")
    if args.with_tracking:
        accelerator.end_training()
    return 0


def main(argv=None) -> int:
    return run_cli(parse_args, run, argv)


# ------------------------------------------------------------------------------------------------- model
def load_model_and_tokenizer(args, signal_ids: set[int]):
    """The model (with a learned start signal when one is used) and its tokenizer."""
    path = args.model_name_or_path
    try:
        config = BriLLMConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise UsageError(f"--model_name_or_path {path}: not a BriLLM model folder ({str(err).splitlines()[0]}).") \
            from None
    needed = max(signal_ids) + 1
    learn = (args.train_only == "start_signal" or needed > 1) and config.start_signal == "uniform"
    # the release's uniform start as learned signals initialised to 1/d: the same model, now trainable
    overrides = {"start_signal": "learned", "num_start_signals": needed} if learn else {}
    model = load_model(path, BriLLMForCausalLM, **overrides)
    signals = model.base_model.start_signals
    if signals is not None and model.config.num_start_signals < needed:  # more signals, each the uniform start 1/d
        extra = signals.new_full((needed - signals.shape[0], signals.shape[1]), 1.0 / model.config.node_size)
        model.base_model.start_signals = torch.nn.Parameter(torch.cat([signals.data, extra]))
        model.config.num_start_signals = needed
    tokenizer = load_tokenizer(args.tokenizer_name or path)
    if len(tokenizer) > model.config.vocab_size:
        raise UsageError(f"the tokenizer has {len(tokenizer)} tokens but the model {model.config.vocab_size} nodes: "
                         "use the tokenizer the model was trained with (--tokenizer_name).")
    return model, tokenizer


def touched_edge_rows(model, rows: list[dict]):
    """Sorted edge-table rows of every real edge the sequences cross (consecutive pairs; the shared row 0 left out)."""
    seqs = [torch.tensor(r["input_ids"], device=model.input_device) for r in rows if len(r["input_ids"]) > 1]
    if not seqs:
        return torch.zeros(0, dtype=torch.long)
    touched = model.edge_rows(torch.cat([s[:-1] for s in seqs]), torch.cat([s[1:] for s in seqs])).unique()
    return touched[touched > 0]


def restrict_training(model, train_only: str, train_rows: list[dict], optimizer) -> tuple[int, str]:
    """Freeze what `train_only` leaves out; returns (trainable numbers, a line saying what is trained)."""
    d = model.config.node_size
    model.requires_grad_(train_only == "all")
    if train_only == "all":
        return sum(p.numel() for p in model.parameters()), "every parameter"
    if train_only == "node_bias":
        model.base_model.node_bias.requires_grad_(True)
        return model.base_model.node_bias.numel(), f"the node biases ({model.config.vocab_size:,} x {d})"
    if train_only == "start_signal":
        model.base_model.start_signals.requires_grad_(True)
        n = model.config.num_start_signals
        return model.base_model.start_signals.numel(), f"the learned start signal{'s' if n > 1 else ''} ({n} x {d})"
    touched = touched_edge_rows(model, train_rows)
    mask_untouched_rows(model, touched, optimizer)
    base = model.base_model
    count = int(touched.numel()) * sum(getattr(base, n)[0].numel() for n in base.edge_row_parameters)
    return count, (f"the {touched.numel():,} edges the data crosses, of {model.config.num_edges:,} "
                   f"({touched.numel() / max(model.config.num_edges, 1):.1%})")


def mask_untouched_rows(model, touched, optimizer):
    """Train only the edge rows `touched`: their gradients are masked as each is accumulated (clipping sees the
    masked gradient) and again before every `optimizer` step (DDP's all-reduce in between cannot move a row)."""
    base = model.base_model
    rows = [getattr(base, name) for name in base.edge_row_parameters]  # every parameter indexed by edge row
    allowed = torch.zeros(rows[0].shape[0], dtype=torch.bool, device=rows[0].device)
    allowed[touched.to(allowed.device)] = True

    def mask(param):
        grad = param.grad
        if grad is None:
            return
        keep = allowed.to(grad.device)  # the model may have moved since the mask was made
        if grad.is_sparse:
            indices, values = grad._indices(), grad._values()
            kept = keep[indices[0]]
            param.grad = torch.sparse_coo_tensor(indices[:, kept], values[kept], grad.shape, check_invariants=False)
        else:
            grad.masked_fill_(~keep.view(-1, *([1] * (grad.dim() - 1))), 0)

    for param in rows:
        param.requires_grad_(True)
        param.register_post_accumulate_grad_hook(mask)

    def before_step(*_):  # returns None: a pre-hook's return value would replace the step's arguments
        for param in rows:
            mask(param)

    optimizer.register_step_pre_hook(before_step)


# -------------------------------------------------------------------------------------------------- data
def load_everything(args, accelerator):
    """Records, model and tokenizer (on the training device), and the tokenized training / validation rows."""
    records = load_records(args.train_file) if args.train_file else builtin_pairs()
    if args.validation_file:
        train_records, val_records = records, load_records(args.validation_file)
        data_line = f"{args.train_file} + {args.validation_file}"
    else:
        train_records, val_records = split_records(records, args.validation_split_percentage)
        data_line = (f"{args.train_file} ({len(val_records)} of {len(records)} records held out)" if args.train_file
                     else f"built-in topic/summary pairs of pydoc_data ({len(val_records)} of {len(records)} held out)")
    signal_ids = {r.get("signal_id", args.signal_id) for r in train_records + val_records}
    model, tokenizer = load_model_and_tokenizer(args, signal_ids)
    # On the training device from here on, so every tensor made from the model (the samples before training, the
    # touched-edge mask, the optimizer state) is made where the model trains; prepare() then moves nothing.
    model.to(accelerator.device)
    max_length = min(args.max_length or model.config.max_position_embeddings, model.config.max_position_embeddings)
    train_rows, dropped = tokenize_records(train_records, tokenizer, max_length, args.signal_id)
    val_rows, val_dropped = tokenize_records(val_records, tokenizer, max_length, args.signal_id)
    if not train_rows:
        raise UsageError(f"no training record keeps a completion token within --max_length {max_length}; raise it.")
    accelerator.print(f"data: {data_line}: {len(train_rows)} training, {len(val_rows)} validation sequences"
                      + (f" ({dropped + val_dropped} dropped: no completion token within {max_length} tokens)"
                         if dropped + val_dropped else ""))
    return SimpleNamespace(model=model, tokenizer=tokenizer, train_rows=train_rows, val_rows=val_rows,
                           val_records=val_records, line=data_line, max_length=max_length,
                           learned=model.base_model.start_signals is not None, pad_id=tokenizer.pad_token_id or 0)


# --------------------------------------------------------------------------------------- train, evaluate
def prepare_training(args, data, accelerator):
    """Optimizer (over what --train_only leaves trainable), loaders and schedule, prepared by accelerate."""
    model = data.model
    lr = args.learning_rate or DEFAULT_LR[args.train_only]
    plan = choose_optimizer(args.optimizer, accelerator.num_processes, args.max_grad_norm,
                            fsdp=accelerator.distributed_type.value == "FSDP")
    optimizer = build_optimizer(model, plan, lr, args.weight_decay, accelerator)
    trainable, what = restrict_training(model, args.train_only, data.train_rows, optimizer)
    total = sum(p.numel() for p in model.parameters())
    accelerator.print(f"model: {args.model_name_or_path}, {total:,} parameters; training {what}: {trainable:,} "
                      f"numbers ({trainable / total:.4%})")

    collate = partial(collate_sft, pad_id=data.pad_id, with_signal_ids=data.learned)
    train_loader = DataLoader(data.train_rows, args.per_device_train_batch_size, shuffle=True, collate_fn=collate,
                              generator=torch.Generator().manual_seed(args.seed))
    val_loader = DataLoader(data.val_rows, args.per_device_eval_batch_size, collate_fn=collate,
                            generator=torch.Generator().manual_seed(args.seed)) if data.val_rows else None
    steps_per_epoch = math.ceil(len(train_loader) / args.gradient_accumulation_steps)
    max_steps = args.max_train_steps or args.num_train_epochs * steps_per_epoch
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=max_steps)
    model, optimizer, train_loader, val_loader, scheduler = accelerator.prepare(  # passes a None loader through
        model, optimizer, train_loader, val_loader, scheduler)
    return SimpleNamespace(model=model, optimizer=optimizer, scheduler=scheduler, train_loader=train_loader,
                           val_loader=val_loader, plan=plan, lr=lr, max_steps=max_steps,
                           steps_per_epoch=steps_per_epoch, trainable=trainable, total=total)


def train(args, data, job, accelerator) -> tuple[int, list[float], float]:
    """Optimizer steps to --max_train_steps (or the epochs); returns (steps, losses, seconds)."""
    step = TrainStep(accelerator, job.model, job.optimizer, job.scheduler,
                     per_device_batch_size=args.per_device_train_batch_size, block_size=data.max_length,
                     max_grad_norm=args.max_grad_norm, clip=job.plan.clip, learning_rate=job.lr)
    accelerator.print(f"training: {job.max_steps} steps ({job.steps_per_epoch} per epoch), lr {job.lr:g} "
                      f"({args.lr_scheduler_type}), optimizer {job.plan.name}")
    job.model.train()
    started, losses = time.perf_counter(), []
    epochs = itertools.chain.from_iterable(map(step, job.train_loader) for _ in itertools.count())  # None: accumulating
    for completed, result in enumerate(itertools.islice(filter(None, epochs), job.max_steps), 1):
        losses.append(result.loss)
        if completed % args.logging_steps == 0 or completed == job.max_steps:
            accelerator.print(f"step {completed}: loss {result.loss:.4f}, lr {result.lr:.3g}")
    return len(losses), losses, time.perf_counter() - started


@torch.no_grad()
def complete(model, tokenizer, records, args) -> list[str]:
    """Greedy completions of the prompts of `records`, computed where the model is: its inputs follow it."""
    device, out = model.input_device, []
    model.eval()
    for record in records:
        enc = tokenizer(record.get("prompt", ""), return_tensors="pt").to(device)
        room = model.config.max_position_embeddings - enc["input_ids"].shape[1]
        extra = {} if model.base_model.start_signals is None else {
            "signal_ids": torch.tensor([record.get("signal_id", args.signal_id)], device=device)}
        ids = model.generate(**enc, max_new_tokens=max(0, min(args.max_new_tokens, room)), do_sample=False,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **extra)
        out.append(tokenizer.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    model.train()
    return out


def evaluate_completions(model, loader, accelerator) -> dict:
    loss, ppl, n = evaluate(model, loader, accelerator) if loader is not None else (math.nan, math.nan, 0)
    return {"loss": loss, "perplexity": ppl, "tokens": n}


def compare_samples(args, data, job, sample_records, samples_before, accelerator) -> list[dict]:
    """Greedy completions of validation prompts after training, beside those before and the references."""
    if not (accelerator.is_main_process and sample_records):
        return []
    after = complete(accelerator.unwrap_model(job.model), data.tokenizer, sample_records, args)
    samples = [{"prompt": record["prompt"], "before": old, "after": new, "reference": record["completion"]}
               for record, old, new in zip(sample_records, samples_before, after)]
    accelerator.print("greedy completions of validation prompts (before | after | reference):")
    for s in samples:
        accelerator.print(f"  {s['prompt']!r}\n    before: {s['before']!r}\n    after : {s['after']!r}\n"
                          f"    ref   : {s['reference']!r}")
    return samples


# ------------------------------------------------------------------------------------------------- save
def save_folder(accelerator, model, tokenizer, folder, results: dict, data_line: str):
    """save_pretrained, tokenizer, model card and results staged beside the old model, then swapped in."""
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.sparse_gradients = False
    state_dict = accelerator.get_state_dict(model)
    fix = f"the model that was in {folder.path} is intact"
    with folder.staging(accelerator, "the fine-tuned model", fix) as staged:
        unwrapped.save_pretrained(staged, is_main_process=accelerator.is_main_process, save_function=accelerator.save,
                                  state_dict=state_dict, safe_serialization=True)
        if accelerator.is_main_process:
            tokenizer.model_max_length = unwrapped.config.max_position_embeddings
            tokenizer.save_pretrained(staged)
            write_card(staged, unwrapped, tokenizer, results, data_line, folder.path.name)
            write_json(staged / RESULTS_NAME, results)
    if accelerator.is_main_process:
        folder.install()
    accelerator.wait_for_everyone()


def write_card(folder, model, tokenizer, results: dict, data_line: str, name: str):
    """The fine-tuned folder's model card: what was trained, on what, the completion perplexity before and after."""
    before, after = results["before"]["perplexity"], results["after"]["perplexity"]
    signal = f"; generate with `signal_ids=torch.tensor([{results['signal_id']}])`." if results["signal_id"] else "."
    description = (f"A **BriLLM** model fine-tuned from `{results['base_model']}` on {data_line}, with the loss "
                   f"on the completions only. {HOW[results['train_only']].format(signal=signal)} Completion "
                   f"perplexity of the held-out pairs: {before:,.2f} before, {after:,.2f} after.")
    write_model_card(folder, model, tokenizer, metrics={"completion_perplexity": after,
                                                        "completion_perplexity_before": before},
                     description=description, tags=["fine-tuned"], model_name=name)


# -------------------------------------------------------------------------------------------------- records
class SFTDataError(UsageError, ValueError):
    """Unusable fine-tuning data (a missing field, an empty file): the message names the problem and the fix."""


_HEADING = re.compile(r"^\s*([*=~^#-])\1{3,}\s*$")
_SENTENCE_END = re.compile(r"(?<=[a-z0-9)\"'][.!?])\s+(?=[A-Z\"'(])")


def builtin_pairs() -> list[dict]:
    """Topic/summary pairs from `pydoc_data.topics` (no download): a section heading, the first sentence under it."""
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        raise SFTDataError("this Python has no pydoc_data (the built-in fine-tuning set); pass --train_file.") from None
    pairs, seen = [], set()
    for key in sorted(topics):
        lines = topics[key].split("\n")
        for i, title in ((i, lines[i].strip()) for i in range(len(lines) - 1)):
            if not title or not _HEADING.match(lines[i + 1]) or len(lines[i + 1].strip()) != len(title):
                continue
            answer, title = _first_sentence(lines[i + 2:]), title.strip('"').replace('"', "")
            if answer is not None and title.lower() not in seen and len(title) <= 60:
                seen.add(title.lower())
                pairs.append({"prompt": f"Topic: {title}\nSummary:", "completion": " " + answer})
    return pairs


def _first_sentence(lines: list[str]) -> str | None:
    """The first sentence of the first prose paragraph in `lines` (before the next heading), or None."""
    paragraph: list[str] = []
    for j, line in enumerate(lines):
        heading = j + 1 < len(lines) and _HEADING.match(lines[j + 1]) and line.strip()
        prose = line.strip() and not line.startswith((" ", "\t")) and not _HEADING.match(line)  # not code or a table
        if heading or (paragraph and not prose):
            break
        if prose:
            paragraph.append(line.strip())
    text = " ".join(paragraph).replace('"', "")
    sentence = _SENTENCE_END.split(text)[0]
    return sentence if paragraph and sentence.endswith((".", ":")) and 5 <= len(sentence.split()) <= 40 else None


def load_records(path) -> list[dict]:
    """Records from a .jsonl / .json / .txt file, checked with `check_records`."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise SFTDataError(f"{path}: no such file.")
    extension = Path(path).suffix.lower()
    if extension not in (".txt", ".text", ".jsonl", ".json"):
        raise SFTDataError(f"{path}: unknown file extension {extension or '(none)'!r}; use .jsonl (one "
                           "{\"prompt\": ..., \"completion\": ...} object per line), .json (a list of them) "
                           "or .txt (one plain text per line).")
    text = Path(path).read_text(encoding="utf-8")
    if extension in (".txt", ".text"):
        records = [{"text": line} for line in text.split("\n") if line.strip()]
    elif extension == ".jsonl":
        records = [_parse_json(line, f"{path}, line {number}", "; a .jsonl file holds one JSON object per line.")
                   for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    else:
        records = _parse_json(text, path)
        if isinstance(records, dict) and isinstance(records.get("data"), list):
            records = records["data"]
        if not isinstance(records, list):
            raise SFTDataError(f"{path}: expected a JSON list of records (or {{\"data\": [...]}}).")
    return check_records(records, path)


def _parse_json(text: str, where: str, hint: str = "."):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise SFTDataError(f"{where}: not valid JSON ({err.msg}){hint}") from None


def check_records(records, source: str = "the data") -> list[dict]:
    """Raise `SFTDataError` naming the first bad record; returns the records."""
    if not records:
        raise SFTDataError(f"{source} holds no records: give at least one {{\"prompt\": ..., \"completion\": ...}} "
                           "(or {\"text\": ...}) record.")
    for number, record in enumerate(records, 1):
        if problem := _record_problem(record):
            raise SFTDataError(f"{source}, record {number}{problem}")
    return list(records)


def _record_problem(record) -> str | None:
    """What is wrong with one record (the text after "record N"), or None."""
    if not isinstance(record, dict):
        return f" is a {type(record).__name__}, not an object with prompt/completion fields."
    pair = "prompt" in record or "completion" in record
    missing = [k for k in ("prompt", "completion") if k not in record] if pair else []
    if missing:
        return (f" has no {missing[0]!r} field: prompt/completion data needs both fields in every record (the loss "
                "is on the completion); for plain text use {\"text\": ...} records or a .txt file.")
    if not pair and "text" not in record:
        return (f" has neither 'prompt'/'completion' nor 'text' (fields: {sorted(record) or 'none'}); give "
                "{\"prompt\": ..., \"completion\": ...}.")
    for name in ("prompt", "completion") if pair else ("text",):
        if not isinstance(record[name], str):
            return f": {name!r} must be a string, got {type(record[name]).__name__}."
    if not record["completion" if pair else "text"].strip():
        return ": the completion is empty, so there is nothing to learn from it." if pair else ": the text is empty."
    sid = record.get("signal_id", 0)
    if not isinstance(sid, int) or isinstance(sid, bool) or sid < 0:
        return f": signal_id must be a non-negative integer, got {sid!r}."
    return None


def split_records(records: list[dict], percentage: float) -> tuple[list[dict], list[dict]]:
    """(train, validation): every k-th record held out, `percentage` % of them, deterministically."""
    held = set(held_out_indices(len(records), percentage))
    return [r for i, r in enumerate(records) if i not in held], [r for i, r in enumerate(records) if i in held]


def tokenize_records(records: list[dict], tokenizer, max_length: int, default_signal_id: int = 0
                     ) -> tuple[list[dict], int]:
    """Token ids, labels (-100 on the prompt) and signal id of every record, cut to `max_length`; (rows, dropped)."""
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    rows = []
    for record in records:
        if "completion" in record:
            prompt = tokenizer(record["prompt"])["input_ids"]
            completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"] + eos
        else:
            prompt, completion = [], tokenizer(record["text"])["input_ids"] + eos
        labels = ([-100] * len(prompt) + completion)[:max_length]
        if any(label != -100 for label in labels[1:]):  # labels[0] is never a target
            rows.append({"input_ids": (prompt + completion)[:max_length], "labels": labels,
                         "signal_id": record.get("signal_id", default_signal_id)})
    return rows, len(records) - len(rows)


def pad_batch(seqs: list[torch.Tensor], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids right-padded with `pad_id`, attention mask) of 1-D id tensors."""
    ids = torch.nn.utils.rnn.pad_sequence(seqs, batch_first=True, padding_value=pad_id)
    mask = (torch.arange(ids.shape[1]) < torch.tensor([len(s) for s in seqs]).unsqueeze(1)).long()
    return ids, mask


def collate_sft(rows: list[dict], pad_id: int, with_signal_ids: bool = False) -> dict:
    """Right-padded batch: input_ids, attention_mask, labels (-100 on prompt and padding), optionally signal_ids."""
    input_ids, attention_mask = pad_batch([torch.tensor(r["input_ids"], dtype=torch.long) for r in rows], pad_id)
    batch = {"input_ids": input_ids, "attention_mask": attention_mask,
             "labels": pad_batch([torch.tensor(r["labels"], dtype=torch.long) for r in rows], -100)[0]}
    if with_signal_ids:
        batch["signal_ids"] = torch.tensor([r["signal_id"] for r in rows], dtype=torch.long)
    return batch
