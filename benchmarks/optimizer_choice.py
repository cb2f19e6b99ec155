"""`--optimizer auto` vs `adamw` on the demo's model: the training step of examples/pretrain.py
(modeling_brillm.training.loop.TrainStep, clipping included) with SparseAdamW on sparse row gradients and with
fused AdamW on dense gradients, interleaved step by step in one process so a busy machine slows both alike.

    python benchmarks/optimizer_choice.py                 # the demo preset: built-in corpus, V=512, d=32
    python benchmarks/optimizer_choice.py --steps 40 --batch 64

Prints the median step time of each and their ratio. Both models start from the same weights and see the same
batches; their losses drift apart slowly (lazy vs dense AdamW), which the last line shows.
"""

import argparse
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import add_results_dir, write_record  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--warmup", type=int, default=3)
    a = add_results_dir(p).parse_args()
    torch.set_num_threads(1)

    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from modeling_brillm import BriLLMForCausalLM
    from modeling_brillm.training.data import collate, load_raw_data, load_tokenizer, prepare_blocks
    from modeling_brillm.training.loop import TrainStep
    from modeling_brillm.training.memory import keep_freed_memory
    from modeling_brillm.training.optimizers import build_optimizer, choose_optimizer
    from modeling_brillm.training.presets import build_config_and_graph, resolve_settings
    from modeling_brillm.training.pretraining import parse_args

    keep_freed_memory()  # as pretrain.py does on CPU
    args = parse_args(["--config", "demo", "--per_device_train_batch_size", str(a.batch)])
    settings = resolve_settings(args)
    acc = Accelerator(cpu=True)
    raw, _ = load_raw_data(args)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, _ = load_tokenizer(args, settings.section("tokenizer"), raw, tmp, None, acc)
    train_blocks, _, _ = prepare_blocks(raw, tokenizer, args, acc)
    config, graph, _ = build_config_and_graph(settings, tokenizer, train_blocks)
    torch.manual_seed(0)
    base = BriLLMForCausalLM.from_graph(graph, config=config)
    runs = {}
    for name in ("auto", "adamw"):
        model = BriLLMForCausalLM.from_graph(graph, config=config)
        model.load_state_dict(base.state_dict())
        plan = choose_optimizer(name, 1, args.max_grad_norm)
        optimizer = build_optimizer(model, plan, args.learning_rate, args.weight_decay, acc)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        step = TrainStep(acc, model, optimizer, scheduler, per_device_batch_size=a.batch, block_size=args.block_size,
                         max_grad_norm=args.max_grad_norm, clip=plan.clip, learning_rate=args.learning_rate)
        runs[name] = SimpleNamespace(plan=plan, step=step, times=[], loss=None)
    loader = DataLoader(train_blocks, batch_size=a.batch, shuffle=True, collate_fn=collate, drop_last=True,
                        generator=torch.Generator().manual_seed(0))
    batches = iter(loader)
    for i in range(a.warmup + a.steps):
        try:
            batch = next(batches)
        except StopIteration:
            batches = iter(loader)
            batch = next(batches)
        order = ("auto", "adamw") if i % 2 == 0 else ("adamw", "auto")  # alternate who goes first
        for name in order:
            started = time.perf_counter()
            result = runs[name].step(batch)
            elapsed = time.perf_counter() - started
            if i >= a.warmup:
                runs[name].times.append(elapsed)
            runs[name].loss = result.loss
    tokens = a.batch * args.block_size
    print(f"demo model: V={config.vocab_size}, {config.num_edges:,} edges, {base.num_parameters():,} parameters; "
          f"batch {a.batch} x {args.block_size}; {a.steps} timed steps each, interleaved; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
    for name, r in runs.items():
        med = statistics.median(r.times)
        print(f"  --optimizer {name:6s} -> {r.plan.name:12s}: median step {med * 1000:7.1f} ms "
              f"({tokens / med:,.0f} block tokens/s), last loss {r.loss:.4f}")
    ratio = statistics.median(runs["adamw"].times) / statistics.median(runs["auto"].times)
    print(f"auto is {ratio:.2f}x the speed of adamw (median step times)")
    write_record("optimizer_choice", a, dict(
        vocab=config.vocab_size, edges=config.num_edges, parameters=base.num_parameters(), auto_over_adamw=ratio,
        runs={name: dict(optimizer=r.plan.name, median_step_ms=statistics.median(r.times) * 1e3,
                         tokens_per_s=tokens / statistics.median(r.times), last_loss=r.loss)
              for name, r in runs.items()}))


if __name__ == "__main__":
    main()
