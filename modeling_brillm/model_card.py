"""Make a saved BriLLM folder Hub-ready: `write_model_card` (README.md with YAML metadata: library_name, pipeline_tag,
tags, datasets, metrics and their model-index) and `check_hub_ready` ([] when the folder loads from the Hub with
trust_remote_code=True). Uses `huggingface_hub.ModelCard` / `ModelCardData` (installed with transformers)."""

import json
import os
from pathlib import Path

from transformers.dynamic_module_utils import get_relative_imports  # what loading with remote code reads

__all__ = ["write_model_card", "check_hub_ready", "model_card_text"]

PAPER = "BriLLM: Brain-inspired Large Language Model (Zhao et al., 2025)"


def _as_list(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple, set)) else [value]


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _model_facts(model, tokenizer=None) -> dict[str, str]:
    """The card's model table: fact → value."""
    cfg = model.config
    edges = (" (every ordered pair)" if cfg.graph == "dense" else
             f" (avg. {cfg.num_edges / cfg.vocab_size:.1f} successors per node; the rest share one edge)")
    length = (f"unbounded (position_overflow=\"extend\"; {cfg.max_position_embeddings} learned positions)"
              if getattr(cfg, "position_overflow", "error") == "extend" else str(cfg.max_position_embeddings))
    parameters = sum(p.numel() for p in model.parameters())
    facts = {"nodes (vocabulary) V": f"{cfg.vocab_size:,}", "node size d": str(cfg.node_size), "graph": cfg.graph,
             "real edges": f"{cfg.num_edges:,}{edges}", "parameters": f"{parameters:,}", "max sequence length": length,
             "positional encoding": cfg.position_encoding, "training loss": cfg.loss_type}
    if tokenizer is not None:
        facts["tokenizer"] = f"{type(tokenizer).__name__}, {len(tokenizer):,} tokens"
    return facts


def model_card_text(model, tokenizer=None, datasets=None, metrics=None, repo_id: str | None = None,
                    model_name: str | None = None, description: str | None = None, training_data: str | None = None,
                    training: dict | None = None) -> str:
    """The Markdown body of the card (no metadata header)."""
    name = model_name or (repo_id.split("/")[-1] if repo_id else "BriLLM model")
    rid = repo_id or "<namespace>/<model-name>"
    lines = [f"# {name}", "", description or (
        "A **BriLLM** language model: every token of the vocabulary is a node of a directed graph, every edge u→v is "
        "a d×d matrix plus a bias. A signal flows along the path of the input tokens; the next token is the node "
        "whose incoming edge delivers the most energy (the largest L2 norm of the edge's output). There is no "
        "attention and no layer stack; the model's size follows the vocabulary and the edges, not the sequence "
        f"length. Architecture from *{PAPER}*; implementation for 🤗 transformers."), ""]
    lines += ["## Model", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in _model_facts(model, tokenizer).items()] + [""]
    ds = _as_list(datasets)
    if ds or training_data:
        lines += ["## Training data", ""] + [f"- `{d}`" for d in ds]
        lines += ([training_data] if not ds else [f"- {training_data}"]) if training_data else []
        lines += [""]
    if training:
        lines += ["## Training", "", "| | |", "|---|---|"]
        lines += [f"| {k} | {_cell(v)} |" for k, v in training.items()] + [""]
    if metrics:
        lines += ["## Evaluation", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in metrics.items()] + [""]
    return "\n".join(lines + _usage(rid, model.config))


def _usage(rid: str, config) -> list[str]:
    """The card's usage, limitations and citation."""
    extend = getattr(config, "position_overflow", "error") == "extend"
    return [
        "## Usage", "",
        "The model code ships with the weights (`trust_remote_code=True`):", "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline",
        "",
        f'generator = pipeline("text-generation", model="{rid}", trust_remote_code=True)',
        'print(generator("The city", max_new_tokens=20, do_sample=True, top_k=40)[0]["generated_text"])',
        "",
        f'tokenizer = AutoTokenizer.from_pretrained("{rid}", trust_remote_code=True)',
        f'model = AutoModelForCausalLM.from_pretrained("{rid}", trust_remote_code=True)',
        'inputs = tokenizer("The city", return_tensors="pt")',
        "out = model.generate(**inputs, max_new_tokens=20)  # greedy; sampling, beams, streaming all work",
        "print(tokenizer.decode(out[0], skip_special_tokens=True))",
        "```", "",
        "BriLLM's own decoding loop (the next node is the one receiving the most energy; self-loops excluded as in "
        "the paper's release) returns the energy path too:", "",
        "```python",
        "result = model.energy_generate(inputs.input_ids, max_new_tokens=20, do_sample=False)",
        "print(tokenizer.decode(result.sequences[0]))",
        "for step in result.path(0, tokenizer):",
        "    print(step.source_text, '->', step.token_text, f'energy={step.energy:.2f}', f'rank={step.rank}')",
        "```", "",
        "Perplexity with the `evaluate` metric works once the package is imported (it loads the model without "
        "`trust_remote_code`): `import modeling_brillm` first, or use `modeling_brillm.evaluation.perplexity`.", "",
        "## Limitations", "",
        (f"- Sequences of any length are read and generated (`position_overflow=\"extend\"`): positions past the "
         f"trained {config.max_position_embeddings} reuse the last learned position weight (the model learned one "
         "weight per position up to there only)." if extend else
         f"- Sequences hold at most {config.max_position_embeddings} tokens (one learned position weight per "
         "position); longer prompts raise an error (`position_overflow=\"extend\"` reads past them)."),
        "- Generations are mostly fluent for a few tokens and then drift (as reported for BriLLM by its authors).",
        "- No safety tuning: outputs reflect the training data.", "",
        "## Citation", "", f"{PAPER}.", "",
    ]


def write_model_card(output_dir, model, tokenizer=None, datasets=None, metrics=None, repo_id: str | None = None,
                     model_name: str | None = None, tags=None, description: str | None = None,
                     training_data: str | None = None, training: dict | None = None,
                     eval_dataset_name: str | None = None) -> str:
    """Write `output_dir/README.md` (metadata and a card body with a usage snippet) and return its path.
    `datasets`: dataset ids; `metrics`: name → value (a table and `model-index`); `training_data`: a
    sentence on data without a dataset id; `training`: the run's facts (a table); `eval_dataset_name`: what the
    metrics were measured on, when not the first dataset. Written to a temporary name and renamed: never half a card."""
    from huggingface_hub import EvalResult, ModelCard, ModelCardData

    ds = _as_list(datasets)
    metrics = metrics or {}
    name = model_name or (repo_id.split("/")[-1] if repo_id else os.path.basename(os.path.abspath(output_dir)))
    all_tags = ["brillm", "graph-language-model", "brain-inspired", "custom_code"]
    all_tags += [t for t in _as_list(tags) if t not in all_tags]
    dataset = ds[0] if ds else "custom"
    eval_results = [EvalResult(task_type="text-generation", task_name="Text Generation", dataset_type=dataset,
                               dataset_name=eval_dataset_name or dataset, metric_type=k, metric_name=k, metric_value=v)
                    for k, v in metrics.items()] or None
    data = ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=all_tags,
                         license="apache-2.0", datasets=ds or None, metrics=list(metrics) or None,
                         model_name=name if eval_results else None, eval_results=eval_results)
    body = model_card_text(model, tokenizer, ds, metrics, repo_id=repo_id, model_name=name,
                           description=description, training_data=training_data, training=training)
    card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{body}")
    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(os.fspath(output_dir), "README.md")
    tmp = f"{path}.tmp-{os.getpid()}"
    card.save(tmp)
    os.replace(tmp, path)
    return path


def check_hub_ready(directory) -> list[str]:
    """What keeps `directory` from loading from the Hub as a BriLLM repo ([] when it is ready): its safetensors
    weights, config.json and the code files its auto_map names, tokenizer, generation config and card metadata."""
    directory = os.fspath(directory)
    files = set(os.listdir(directory)) if os.path.isdir(directory) else set()
    if not files:
        return [f"{directory} is not a folder or is empty."]
    problems = []
    if "model.safetensors" not in files and "model.safetensors.index.json" not in files:
        problems.append("no safetensors weights (model.safetensors or model.safetensors.index.json).")
    if any(f.endswith(".bin") for f in files):
        problems.append("pickle weights (*.bin) present: ship safetensors only.")
    problems += _config_problems(directory, files) + _tokenizer_problems(directory, files)
    if "generation_config.json" not in files:
        problems.append("no generation_config.json.")
    problems += _card_problems(directory, files)
    if os.path.isdir(os.path.join(directory, "custom_generate")):
        problems.append("custom_generate/ folder present: transformers would replace model.generate with it when "
                        "loading with trust_remote_code=True; publish it as its own repo instead.")
    return problems


def _config_problems(directory: str, files: set) -> list[str]:
    """config.json: the brillm type, an auto_map, and the code files it names (with their relative imports)."""
    if "config.json" not in files:
        return ["no config.json."]
    config = json.loads(Path(directory, "config.json").read_text(encoding="utf-8"))
    problems = [] if config.get("model_type") == "brillm" else [
        f"config.json model_type is {config.get('model_type')!r}, not 'brillm'."]
    auto_map = config.get("auto_map") or {}
    problems += [f"config.json auto_map lacks {key} (save with `import modeling_brillm` done)."
                 for key in ("AutoConfig", "AutoModelForCausalLM") if key not in auto_map]
    pending, seen = [ref.split(".")[0] + ".py" for ref in auto_map.values() if isinstance(ref, str)], set()
    while pending:
        module = pending.pop()
        if module in seen:
            continue
        seen.add(module)
        if module not in files:
            problems.append(f"remote-code file {module} (named by auto_map or imported) is missing.")
            continue
        pending += [rel + ".py" for rel in get_relative_imports(Path(directory, module))]
    return problems


def _tokenizer_problems(directory: str, files: set) -> list[str]:
    if not ({"tokenizer.json", "tokenizer_config.json"} & files):
        return ["no tokenizer (tokenizer.json / tokenizer_config.json): save the tokenizer beside the model."]
    path = Path(directory, "tokenizer_config.json")
    if path.name in files and json.loads(path.read_text(encoding="utf-8")).get("pad_token") is None:
        return ["the tokenizer has no pad token: batched pipelines and the `evaluate` perplexity metric need one."]
    return []


def _card_problems(directory: str, files: set) -> list[str]:
    if "README.md" not in files:
        return ["no README.md model card (modeling_brillm.model_card.write_model_card)."]
    from huggingface_hub import metadata_load  # the Hub's own reading of a card's YAML header

    meta = metadata_load(Path(directory, "README.md"))
    if meta is None:
        return ["README.md has no YAML metadata header."]
    expected = {"library_name": "transformers", "pipeline_tag": "text-generation"}
    problems = [f"README.md metadata: {key} should be {value}." for key, value in expected.items()
                if meta.get(key) != value]
    if "brillm" not in (meta.get("tags") or []):
        problems.append("README.md metadata: tags should include brillm.")
    return problems
