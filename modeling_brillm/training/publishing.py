"""Publishing: a training run's model card, the upload to the Hub, and `push_main` (examples/push_to_hub.py)."""

import argparse
import os

import huggingface_hub  # read at call time: HfApi and HF_HUB_OFFLINE as they are then

from modeling_brillm.model_card import check_hub_ready, write_model_card

from .checkpoints import LOCK_NAME, TMP_PREFIX
from .data import HELD_OUT
from .errors import UsageError, load_model, load_tokenizer, run_cli

# what an upload of a saved folder leaves out: training checkpoints, half-written files, the run's lock, bytecode
HUB_IGNORE = ["step_*", "step_*/**", TMP_PREFIX + "*", LOCK_NAME, "__pycache__/*", "*.pyc"]


def data_facts(args, description: str) -> tuple[list[str], str | None, str]:
    """(dataset ids for the card's metadata, a sentence on data without an id, what validation ran on);
    `description` is data.load_raw_data's sentence (it says when texts were held out)."""
    ids = [args.dataset_name] if args.dataset_name else []
    if args.dataset_name:
        text = f"configuration `{args.dataset_config_name}`" if args.dataset_config_name else None
    elif args.train_file:
        text = f"a local text file (`{os.path.basename(args.train_file)}`)"
    else:
        text = "the English documentation text shipped with CPython (`pydoc_data.topics`)"
    if HELD_OUT in description:
        return ids, text, f"every {100 / args.validation_split_percentage:.0f}th training text, held out"
    return ids, text, f"`{os.path.basename(args.validation_file)}`" if args.validation_file else \
        "the dataset's validation split"


def write_training_card(out_dir, model, tokenizer, args, summary: dict, description: str, repo_id: str | None = None,
                        optimizer: str | None = None, name: str | None = None) -> str:
    """README.md of a trained folder (named `name`): metadata, the run's facts, a usage snippet; returns its path."""
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
        training.update({"validation loss": summary["eval_loss"], "validation data": held})
    if "perplexity_before" in summary:
        training["validation perplexity before training"] = summary["perplexity_before"]
    return write_model_card(out_dir, model, tokenizer, datasets=ids, metrics=metrics, repo_id=repo_id,
                            model_name=None if repo_id else name, training_data=text, training=training,
                            eval_dataset_name=held if metrics else None, tags=["pretraining"])


def push_folder(out_dir, repo_id: str, token: str | None, message: str, before_upload=None, private: bool = False,
                ignore=()) -> str:
    """Create (or reuse) the Hub repository and upload `out_dir` without its checkpoints; returns the full repo id.
    `before_upload(repo_id)` runs once the full id (with namespace) is known, e.g. to rewrite the card."""
    try:
        api = huggingface_hub.HfApi(token=token)
        repo_id = getattr(api.create_repo(repo_id, private=private, exist_ok=True), "repo_id", repo_id)
        if before_upload is not None:
            before_upload(repo_id)
        api.upload_folder(folder_path=str(out_dir), repo_id=repo_id, commit_message=message,
                          ignore_patterns=HUB_IGNORE + list(ignore))
    except Exception as err:  # network, auth, permission: say what happened, upload nothing further
        raise UsageError(f"upload to {repo_id} failed ({type(err).__name__}: {err}). Check the network and your token "
                         f"(`hf auth login` or HF_TOKEN); the model is in {out_dir}.") from None
    return repo_id


def parse_push_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Publish a saved BriLLM folder on the Hugging Face Hub.")
    p.add_argument("--model", required=True, help="saved model folder (save_pretrained of model and tokenizer)")
    p.add_argument("--repo_id", required=True, help="namespace/name on the Hub")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", default=None, help="better `hf auth login` or HF_TOKEN, off the command line")
    p.add_argument("--dataset", action="append", help="training dataset id for the card (repeatable)")
    p.add_argument("--metric", action="append", help="name=value for the card (repeatable)")
    p.add_argument("--rewrite_card", action="store_true", help="write README.md even if the folder has one")
    p.add_argument("--commit_message", default="Upload BriLLM model")
    p.add_argument("--dry_run", action="store_true", help="prepare and check the folder, upload nothing")
    return p.parse_args(argv)


def parse_metrics(items) -> dict:
    metrics = {}
    for name, sep, value in (item.partition("=") for item in items or []):
        if not sep or not name:
            raise ValueError(f"--metric takes name=value, got {name + sep + value!r}.")
        try:
            metrics[name] = float(value)
        except ValueError:
            metrics[name] = value
    return metrics


def push_main(argv=None) -> int:
    return run_cli(parse_push_args, push, argv, (UsageError, ValueError, OSError))


def push(args) -> int:
    prepare_folder(args)
    if args.dry_run:
        print(f"{args.model} is Hub-ready; dry run, nothing uploaded.")
        return 0
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ValueError("offline (HF_HUB_OFFLINE is set): nothing uploaded. The folder is Hub-ready; run again "
                         "with network access.")
    repo_id = push_folder(args.model, args.repo_id, args.token, args.commit_message, private=args.private,
                          ignore=["*.bin", ".git/*"])
    print(f"uploaded {args.model} to https://huggingface.co/{repo_id}")
    return 0


def prepare_folder(args):
    """The model card written where the folder has none (or --rewrite_card); ValueError unless it is Hub-ready."""
    folder = args.model
    if not os.path.isdir(folder):
        raise ValueError(f"{folder} is not a folder: save the model with save_pretrained first.")
    readme = os.path.join(folder, "README.md")
    if args.rewrite_card or not os.path.exists(readme):
        try:
            tokenizer = load_tokenizer(folder)
        except UsageError:
            tokenizer = None  # the readiness check below names it
        write_model_card(folder, load_model(folder), tokenizer, datasets=args.dataset, repo_id=args.repo_id,
                         metrics=parse_metrics(args.metric) or None)
        print(f"wrote the model card {readme}")
    if problems := check_hub_ready(folder):
        raise ValueError("the folder is not Hub-ready:\n  - " + "\n  - ".join(problems))
