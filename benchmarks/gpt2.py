"""The GPT-2 side of quality.py: transformers' GPT2LMHeadModel on a BriLLM row's blocks, batch order, step, training
clock, schedule and evaluator (the pretraining code's). GPT-2's recipe: fused AdamW (weight decay 0.01 on matrices),
--gpt2_warmup steps of linear warmup, then the rule every model follows over the clock; gradient norm clipped at 1.0,
dropout 0, tied embeddings. The rate: the size's `@lr`, else --gpt2_lr (3e-3 was the best of 1e-3 / 3e-3 / 6e-3 /
1.2e-2 for 2x64 and 4x128 at 100 and 300 steps of batch 64 on the embedded corpus; 4x256 does better at 1e-3).
"""

import itertools
import math
import re
import time

import torch
from common import other_cpu_load, sync

from modeling_brillm.training.epochs import TrainingClock, make_schedule
from modeling_brillm.training.errors import UsageError
from modeling_brillm.training.loop import TrainStep, evaluate

SIZE = re.compile(r"^(\d+)x(\d+)(?:x(\d+))?(?:@([0-9.eE+-]+))?$")  # layers x width [x heads] [@lr]
SCHEDULERS = {"linear": "linear", "constant": "constant_with_warmup", "cosine": "cosine"}  # pretrain.py's names


def sizes(specs, default_lr: float) -> list[tuple[int, int, int, float]]:
    """(layers, width, heads, learning rate) of every --gpt2 spec; none for `--gpt2 none`."""
    return [] if [s.lower() for s in specs] == ["none"] else [size(spec, default_lr) for spec in specs]


def size(spec: str, default_lr: float) -> tuple[int, int, int, float]:
    match = SIZE.match(spec)
    if not match:
        raise UsageError(f"--gpt2 {spec!r}: give layers x width [x heads] [@learning rate], e.g. 2x64, 4x256x8 or "
                         "4x256@1e-3.")
    layers, width = int(match.group(1)), int(match.group(2))
    heads = int(match.group(3)) if match.group(3) else max(1, width // 32)
    if min(layers, width, heads) < 1 or width % heads:
        raise UsageError(f"--gpt2 {spec!r}: layers, width and heads must be positive, the width a multiple of the "
                         "heads.")
    try:
        lr = float(match.group(4)) if match.group(4) else default_lr
    except ValueError:
        lr = math.nan
    if not (lr > 0 and math.isfinite(lr)):
        raise UsageError(f"--gpt2 {spec!r}: the learning rate after @ must be a positive number.")
    return layers, width, heads, lr


def labels_of(ids, mask):  # padding is no target
    return ids.masked_fill(mask == 0, -100)


def target_mask(mask):
    """The targets every model is scored on: position t+1 where tokens t and t+1 are real."""
    return (mask[:, 1:] != 0) & (mask[:, :-1] != 0)


def batch_order(n: int, batch_size: int, seed: int):
    """pretrain.py's batches: a permutation of the blocks per epoch, seeded seed + epoch; full batches only."""
    for epoch in itertools.count():
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        yield from (order[start:start + batch_size] for start in range(0, n - batch_size + 1, batch_size))


def make_gpt2(data, size, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = data["tokenizer"]
    config = GPT2Config(vocab_size=len(tok), n_positions=data["train"][0].shape[1], n_embd=size[1], n_layer=size[0],
                        n_head=size[2], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.bos_token_id,
                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # transformers cannot infer it from the class name (it warns)
    return model


def heldout_nll(model, held, batch_size: int, accelerator) -> tuple[float, int]:
    """(summed NLL in nats, targets) of the held-out blocks through training.loop.evaluate: the full softmax at the
    same targets for every model. Leaves the model in training mode."""
    batches = ({"input_ids": ids, "attention_mask": mask, "labels": labels_of(ids, mask)}
               for ids, mask in zip(held[0].split(batch_size), held[1].split(batch_size)))
    batches = ({k: v.to(accelerator.device) for k, v in batch.items()} for batch in batches)
    loss, _, count = evaluate(model, batches, accelerator)
    return (loss * count if count else 0.0), count


def bigram_reference(data, k: float = 0.1) -> float:
    """Held-out perplexity of add-k bigram counts of the training targets: what the previous token alone gives."""
    V = len(data["tokenizer"])

    def pairs(ids, mask):
        keep = target_mask(mask)
        return ids[:, :-1][keep], ids[:, 1:][keep]

    u, v = pairs(*data["train"])
    counts = torch.bincount(u * V + v, minlength=V * V).view(V, V).double()
    probs = (counts + k) / (counts.sum(1, keepdim=True) + k * V)
    hu, hv = pairs(*data["held"])
    return math.exp(float(-probs[hu, hv].log().mean()))


class BudgetRun:
    """One GPT-2 trained until its clock (seconds of forward, backward and optimizer step) passes the last of `points`
    or --max_train_steps, evaluated each time the clock passes a point."""

    def __init__(self, label, model, data, points, args, batch_size: int, lr: float):
        self.label, self.model, self.data, self.args = label, model, data, args
        accelerator = data["accelerator"]
        self.device = accelerator.device
        groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.01},
                  {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=lr, fused=self.device.type in ("cpu", "cuda"))
        self.clock = TrainingClock(max(points))
        scheduler = make_schedule(optimizer, SCHEDULERS[args.schedule], args.gpt2_warmup, clock=self.clock)
        self.train_step = TrainStep(accelerator, model, optimizer, scheduler, per_device_batch_size=batch_size,
                                    block_size=data["pargs"].block_size, max_grad_norm=1.0, clip=True, learning_rate=lr)
        self.batches = batch_order(len(data["train"][0]), batch_size, args.seed)
        self.pending, self.steps, self.tokens, self.losses = list(points), 0, 0, []
        model.to(self.device).train()
        self.curve = [self.evaluate()]

    def evaluate(self) -> dict:
        total, count = heldout_nll(self.model, self.data["held"], self.args.eval_batch_size, self.data["accelerator"])
        point = dict(train_seconds=round(self.clock.seconds, 3), steps=self.steps, train_tokens=self.tokens,
                     train_loss=sum(self.losses) / len(self.losses) if self.losses else None, eval_nll=total / count,
                     perplexity=math.exp(min(total / count, 700.0)), eval_tokens=count)
        self.losses = []
        print(f"  {self.label:>18} {self.clock.seconds:8.1f}s step {self.steps:6d}  held-out perplexity "
              f"{point['perplexity']:10.2f}", flush=True)
        return point

    def step(self):
        index = next(self.batches)
        ids, mask = self.data["train"][0][index], self.data["train"][1][index]
        sync(self.device)
        started = time.perf_counter()
        ids, mask = ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
        loss = float(self.train_step({"input_ids": ids, "attention_mask": mask, "labels": labels_of(ids, mask)}).loss)
        sync(self.device)
        self.clock.seconds += time.perf_counter() - started
        self.steps, self.tokens = self.steps + 1, self.tokens + int(mask.sum())
        self.losses.append(loss)
        if not math.isfinite(loss):
            raise RuntimeError(f"{self.label}: the training loss is {loss} at step {self.steps}; lower its rate.")

    def train(self) -> dict:
        others, wall = other_cpu_load(), time.perf_counter()
        while self.pending and self.steps < (self.args.max_train_steps or math.inf):
            self.step()
            if self.clock.seconds >= self.pending[0]:
                self.pending = [p for p in self.pending if p > self.clock.seconds]
                self.curve.append(self.evaluate())
        if self.curve[-1]["steps"] < self.steps:  # stopped by the step cap: its final evaluation
            self.curve.append(self.evaluate())
        return dict(curve=self.curve, steps=self.steps, train_seconds=round(self.clock.seconds, 3),
                    tokens_per_second=round(self.tokens / max(self.clock.seconds, 1e-9), 1),
                    other_cpu_load=round(others(), 3), wall_seconds=round(time.perf_counter() - wall, 1))


def row(size, data, points, args, batch_size: int) -> dict:
    """One GPT-2 row: the same blocks, batch order, step, clock, schedule and evaluator as the BriLLM rows."""
    model = make_gpt2(data, size, args.seed)
    label, parameters = f"GPT-2 {size[0]}L {size[1]}w {size[2]}h", sum(p.numel() for p in model.parameters())
    print(f"\n{label}: {parameters:,} parameters; AdamW (fused) lr {size[3]}, batch {batch_size}", flush=True)
    result = BudgetRun(label, model, data, points, args, batch_size, size[3]).train()
    schedule = ("constant after warmup" if args.schedule == "constant"
                else f"{args.schedule} over {max(points):g} training seconds to zero, after warmup")
    return dict(kind="gpt2", label=label, parameters=parameters, size=dict(zip(("layers", "width", "heads"), size)),
                optimizer="adamw (fused)", lr=size[3], weight_decay=0.01, warmup_steps=args.gpt2_warmup,
                schedule=schedule, grad_clip=1.0, batch_size=batch_size, **result)
