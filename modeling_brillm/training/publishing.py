"""The end of a training run: the model card written at the final save, and the upload to the Hub."""

from __future__ import annotations

import os

from .checkpoints import TMP_PREFIX
from .data import HELD_OUT
from .errors import UsageError

# what an upload of a saved folder leaves out: training checkpoints, half-written files, bytecode
HUB_IGNORE = ["step_*", "step_*/**", TMP_PREFIX + "*", "__pycache__/*", "*.pyc"]


def data_facts(args, description: str) -> tuple[list[str], str | None, str]:
    """(dataset ids for the card's metadata, a sentence on data without an id, what validation ran on);
    `description` is data.load_raw_data's sentence (it says when texts were held out)."""
    if args.dataset_name:
        ids = [args.dataset_name]
        text = f"configuration `{args.dataset_config_name}`" if args.dataset_config_name else None
    elif args.train_file:
        ids = []
        text = f"a local text file (`{os.path.basename(args.train_file)}`)"
    else:
        ids = []
        text = "the English documentation text shipped with CPython (`pydoc_data.topics`)"
    if HELD_OUT in description:
        held = f"every {100 / args.validation_split_percentage:.0f}th training text, held out"
    elif args.validation_file:
        held = f"`{os.path.basename(args.validation_file)}`"
    else:
        held = "the dataset's validation split"
    return ids, text, held


def write_training_card(out_dir, model, tokenizer, args, summary: dict, description: str, repo_id: str | None = None,
                        optimizer: str | None = None) -> str:
    """README.md of a trained folder: metadata (library_name, pipeline_tag, tags, datasets, the final validation
    perplexity as a model-index metric), the run's facts and a usage snippet. Returns its path."""
    from modeling_brillm.model_card import write_model_card

    ids, text, held = data_facts(args, description)
    metrics = {"perplexity": round(summary["perplexity"], 4)} if "perplexity" in summary else None
    training = {
        "optimizer steps": summary.get("steps"),
        "global batch": f"{summary.get('global_batch')} blocks of {args.block_size} tokens ({args.block_mode} blocks)",
        "training tokens (real, all steps)": summary.get("train_tokens"),
        "optimizer": f"{optimizer or args.optimizer}, lr {args.learning_rate} ({args.lr_scheduler_type}, "
                     f"{args.num_warmup_steps} warmup), weight decay {args.weight_decay}",
        "processes": summary.get("processes"),
    }
    if "eval_loss" in summary:
        training["validation loss"] = summary["eval_loss"]
        training["validation data"] = held
    if "perplexity_before" in summary:
        training["validation perplexity before training"] = summary["perplexity_before"]
    return write_model_card(out_dir, model, tokenizer, datasets=ids, metrics=metrics, repo_id=repo_id,
                            training_data=text, training=training, eval_dataset_name=held if metrics else None,
                            tags=["pretraining"])


def push_folder(out_dir, repo_id: str, token: str | None, message: str, before_upload=None) -> str:
    """Create (or reuse) the Hub repository and upload `out_dir` without its checkpoints; returns the full repo
    id. `before_upload(repo_id)` runs once the full id (with namespace) is known, e.g. to rewrite the card."""
    from huggingface_hub import HfApi

    try:
        api = HfApi(token=token)
        repo_id = api.create_repo(repo_id, exist_ok=True).repo_id
        if before_upload is not None:
            before_upload(repo_id)
        api.upload_folder(folder_path=str(out_dir), repo_id=repo_id, commit_message=message,
                          ignore_patterns=HUB_IGNORE)
    except Exception as err:
        raise UsageError(f"push to the Hub ({repo_id}) failed: {type(err).__name__}: {err}. The model is "
                         f"saved in {out_dir}.") from None
    return repo_id
