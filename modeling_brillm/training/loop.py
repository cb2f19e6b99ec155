"""The training step, evaluation and sample generation. A step's loss and gradient are those of the mean over the
whole global batch, its dropout masks keyed by global row and step: the same at any process count (docs/training.md)."""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from modeling_brillm.recurrence import mix64

from .data import count_targets, split_sentences
from .fsdp import reshard

# Prompts for the embedded corpus (Python's documentation); other data uses the start of validation sentences.
DEFAULT_PROMPTS = ["The return value", "An exception is raised", "If the object", "A class definition"]


def _extra_inputs(batch) -> dict:
    """Optional model inputs a batch may carry: `signal_ids` (learned start signals, fine-tuning data)."""
    return {"signal_ids": batch["signal_ids"]} if "signal_ids" in batch else {}


class StepKeys:
    """Where a training step object stands, for the dropout masks: `steps` optimizer steps completed, `micro`
    micro-batches into the next; `seed` the run's (None: torch's initial seed, read so a run keeps its stream)."""

    def keys_from(self, accelerator, per_device_batch_size: int, seed: int | None):
        self.keys_accelerator, self.per_device_batch_size = accelerator, per_device_batch_size
        self.seed = torch.initial_seed() if seed is None else seed
        self.steps = self.micro = 0

    def dropout_inputs(self, batch, step: int | None) -> dict:
        """The model's `dropout_rows` / `dropout_seed`. Accelerate deals batch k to process k mod W from one order of
        the blocks, so local row i is row (micro · W + rank) · batch + i of the step's global batch: the index the same
        block has with one process and W times the batch."""
        acc, rows = self.keys_accelerator, batch["input_ids"].shape[0]
        first = (self.micro * acc.num_processes + acc.process_index) * self.per_device_batch_size
        return {"dropout_rows": torch.arange(first, first + rows, device=acc.device),
                "dropout_seed": mix64(self.seed, self.steps if step is None else step)}  # the same on every process

    def advance(self, stepped: bool):
        """Count a micro-batch, and the optimizer step it completed."""
        self.micro = 0 if stepped else self.micro + 1
        self.steps += stepped


class StepBase(StepKeys):
    """What both training steps (this TrainStep, sharded.ShardedTrainStep) hold and how they end a micro-batch."""

    def __init__(self, accelerator, model, optimizer, lr_scheduler, *, per_device_batch_size: int, block_size: int,
                 learning_rate: float, max_grad_norm: float | None = None, seed: int | None = None):
        self.accelerator, self.model, self.optimizer, self.lr_scheduler = accelerator, model, optimizer, lr_scheduler
        self.keys_from(accelerator, per_device_batch_size, seed)
        self.ref, self.lr_used = float(per_device_batch_size * block_size), learning_rate
        self.max_grad_norm = max_grad_norm
        self.sums = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, targets, real tokens

    def finish(self, totals) -> "StepResult | None":
        """Count the micro-batch; after an optimizer step, its result from `totals` (loss sum, targets, tokens)."""
        self.advance(totals is not None)
        if totals is None:
            return None
        self.sums.zero_()
        return StepResult(loss=float(totals[0]) / max(float(totals[1]), 1.0), targets=int(totals[1]),
                          tokens=int(totals[2]), lr=self.lr_used)


@dataclass
class StepResult:
    loss: float  # token-weighted mean loss over the global batch
    targets: int  # scored positions in the global batch
    tokens: int  # real (non-padding) tokens in the global batch
    lr: float  # the learning rate the optimizer step used


def _coalesced(grad):
    """A sparse row gradient with its duplicate rows summed. Autograd marks a sum uncoalesced even when its rows are
    unique and increasing (the usual case); then only the flag is set, not a sorted copy of most of the table."""
    if grad.is_coalesced():
        return grad
    rows = grad._indices()[0]
    if grad.sparse_dim() == 1 and (rows.numel() < 2 or bool((rows[1:] > rows[:-1]).all())):
        return torch.sparse_coo_tensor(grad._indices(), grad._values(), grad.shape, is_coalesced=True,
                                       check_invariants=False)
    return grad.coalesce()


def clip_grad_norm_(params, max_norm: float) -> float:
    """`torch.nn.utils.clip_grad_norm_` (L2, in place, returns the norm before clipping) that also takes sparse COO
    gradients, coalesced first so the norm is the dense gradient's; squared in slices, not copied whole."""
    squares = []
    for p in (p for p in params if p.grad is not None):
        if p.grad.is_sparse:
            p.grad = _coalesced(p.grad)
        flat = (p.grad._values() if p.grad.is_sparse else p.grad).detach().reshape(-1)
        squares.append(sum(part.float().pow(2).sum() for part in flat.split(1 << 22)))
    if not squares:
        return 0.0
    total = float(torch.stack(squares).sum().sqrt())
    coef = min(max_norm / (total + 1e-6), 1.0)  # as torch: clamped, applied to every gradient
    if coef < 1.0:
        for p in (p for p in params if p.grad is not None):
            (p.grad._values() if p.grad.is_sparse else p.grad).mul_(coef)
    return total


class TrainStep(StepBase):
    """The single-process / DDP / FSDP step over `accelerator.prepare`d model, optimizer and scheduler, one call per
    micro-batch. Every process backpropagates (sum of its token losses) / ref, ref = per-device batch x block size;
    when gradients sync they are multiplied by G x W x ref / (global targets), undoing accelerate's division by the G
    accumulation steps and DDP's average over W processes: the gradient of the mean loss over the global batch."""

    def __init__(self, accelerator, model, optimizer, lr_scheduler, *, max_grad_norm: float | None, clip: bool = True,
                 **step):
        super().__init__(accelerator, model, optimizer, lr_scheduler, max_grad_norm=max_grad_norm if clip else None,
                         **step)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sparse_gradients = bool(getattr(accelerator.unwrap_model(model), "sparse_gradients", False))

    def __call__(self, batch, step: int | None = None) -> StepResult | None:
        """One micro-batch of optimizer step `step` (0-based: it keys the dropout masks); a StepResult once it steps."""
        acc, model = self.accelerator, self.model
        totals = None
        with acc.accumulate(model):
            n_local = count_targets(batch)
            out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                        labels=batch["labels"], return_logits=False, **_extra_inputs(batch),
                        **self.dropout_inputs(batch, step))
            acc.backward(out.loss * (n_local / self.ref))  # rescaled below to / (global targets)
            self.sums += torch.stack([out.loss.detach().double() * n_local, n_local.double(),
                                      batch["attention_mask"].sum().double()])
            if acc.sync_gradients:
                totals = acc.reduce(self.sums.clone(), reduction="sum")
                self._scale_and_clip(acc.gradient_accumulation_steps * acc.num_processes * self.ref
                                     / max(float(totals[1]), 1.0))
            self.optimizer.step()
            if acc.sync_gradients and not acc.optimizer_step_was_skipped:
                self.lr_used = self.lr_scheduler.get_last_lr()[0]
                self.lr_scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
        return self.finish(totals)

    def _scale_and_clip(self, scale: float):
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(scale)
        if self.max_grad_norm and self.sparse_gradients:  # one process (optimizers.choose_optimizer): no collective
            clip_grad_norm_(self.params, self.max_grad_norm)
        elif self.max_grad_norm:
            self.accelerator.clip_grad_norm_(self.params, self.max_grad_norm)


def evaluate(model, dataloader, accelerator) -> tuple[float, float, int]:
    """(mean loss, perplexity, scored tokens) of the validation blocks: the full softmax whatever the training loss."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    for batch in dataloader:
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           **_extra_inputs(batch)).logits
        mask, labels = batch["attention_mask"], batch["labels"]
        targets = labels[:, 1:].masked_fill((mask[:, 1:] == 0) | (mask[:, :-1] == 0), -100)
        nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                              ignore_index=-100, reduction="none").view(targets.shape)
        per_row = torch.stack([nll.sum(1).double(), (targets != -100).sum(1).double()], 1)  # (B, 2)
        total += accelerator.gather_for_metrics(per_row).sum(0)
    reshard(model)  # FSDP leaves the weights gathered after a forward without backward; checkpoints want shards
    model.train()
    loss_sum, count = float(total[0]), int(total[1])
    if count == 0:
        return float("nan"), float("nan"), 0
    return loss_sum / count, math.exp(min(loss_sum / count, 700.0)), count


def choose_prompts(args, raw_validation, used_builtin: bool) -> list[str]:
    """--prompts, the built-in ones for the embedded corpus, or the first words of validation sentences."""
    if args.prompts:
        return args.prompts[: max(args.num_generations, len(args.prompts))]
    if used_builtin:
        return DEFAULT_PROMPTS[: args.num_generations]
    prompts, texts = [], raw_validation[args.text_column] if raw_validation is not None else []
    for sentence in (s for text in texts for s in split_sentences(text or "")):
        words = sentence.split()
        if len(words) >= 4:
            prompts.append(" ".join(words[:3]))
        elif len(sentence) >= 4 and len(words) == 1:  # e.g. Chinese: the first characters
            prompts.append(sentence[:4])
        if len(prompts) >= args.num_generations:
            break
    return prompts


def generate_samples(model, tokenizer, prompts, args, device) -> list[dict]:
    out = []
    for i, prompt in enumerate(prompts):
        enc = tokenizer(prompt, return_tensors="pt").to(device)
        common = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                      eos_token_id=tokenizer.eos_token_id)
        with torch.no_grad():
            greedy = model.generate(**enc, do_sample=False, **common)
            torch.manual_seed(args.seed + i)
            sampled = model.generate(**enc, do_sample=True, top_k=40, temperature=0.8, **common)
        n = enc["input_ids"].shape[1]
        out.append({"prompt": prompt, "greedy": tokenizer.decode(greedy[0, n:], skip_special_tokens=True),
                    "sampled": tokenizer.decode(sampled[0, n:], skip_special_tokens=True)})
    return out
