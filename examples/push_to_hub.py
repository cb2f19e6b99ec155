"""Publish a saved BriLLM folder on the Hugging Face Hub.

    python examples/push_to_hub.py --model outputs/demo --repo_id your-name/brillm-demo [--private]
    python examples/push_to_hub.py --model outputs/demo --repo_id your-name/brillm-demo \
        --dataset wikimedia/wikipedia --metric perplexity=41.2 --dry_run

Steps: check the folder is Hub-ready (safetensors, config with auto_map, the model's code files, tokenizer,
generation_config.json); write a model card README.md when the folder has none (or with --rewrite_card); then
create the repo and upload the folder with `HfApi.upload_folder`. --dry_run stops before the network.
Needs a token (`hf auth login`, HF_TOKEN, or --token). Offline (HF_HUB_OFFLINE=1 or no network) it says so and
exits with code 2; nothing is uploaded.
"""

from __future__ import annotations

import argparse
import os
import sys


def parse_metrics(items) -> dict:
    metrics = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise ValueError(f"--metric takes name=value, got {item!r}.")
        try:
            metrics[name] = float(value)
        except ValueError:
            metrics[name] = value
    return metrics


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="saved model folder (save_pretrained of model and tokenizer)")
    p.add_argument("--repo_id", required=True, help="namespace/name on the Hub")
    p.add_argument("--private", action="store_true")
    p.add_argument("--token", default=None)
    p.add_argument("--dataset", action="append", help="training dataset id for the card (repeatable)")
    p.add_argument("--metric", action="append", help="name=value for the card (repeatable)")
    p.add_argument("--rewrite_card", action="store_true", help="write README.md even if the folder has one")
    p.add_argument("--commit_message", default="Upload BriLLM model")
    p.add_argument("--dry_run", action="store_true", help="prepare and check the folder, upload nothing")
    args = p.parse_args(argv)

    try:
        from modeling_brillm.model_card import check_hub_ready, write_model_card
        from modeling_brillm.training.publishing import HUB_IGNORE

        folder = args.model
        if not os.path.isdir(folder):
            raise ValueError(f"{folder} is not a folder: save the model with save_pretrained first.")
        readme = os.path.join(folder, "README.md")
        if args.rewrite_card or not os.path.exists(readme):
            from transformers import AutoModelForCausalLM, AutoTokenizer

            import modeling_brillm  # noqa: F401

            model = AutoModelForCausalLM.from_pretrained(folder)
            try:
                tokenizer = AutoTokenizer.from_pretrained(folder)
            except (OSError, ValueError):
                tokenizer = None
            write_model_card(folder, model, tokenizer, datasets=args.dataset,
                             metrics=parse_metrics(args.metric) or None, repo_id=args.repo_id)
            print(f"wrote the model card {readme}")
        problems = check_hub_ready(folder)
        if problems:
            raise ValueError("the folder is not Hub-ready:\n  - " + "\n  - ".join(problems))
        if args.dry_run:
            print(f"{folder} is Hub-ready; dry run, nothing uploaded.")
            return 0
        from huggingface_hub import HfApi
        from huggingface_hub.constants import HF_HUB_OFFLINE

        if HF_HUB_OFFLINE:
            print("error: offline (HF_HUB_OFFLINE is set): nothing uploaded. The folder is Hub-ready; run again with "
                  "network access.", file=sys.stderr)
            return 2
        api = HfApi(token=args.token)
        try:
            url = api.create_repo(args.repo_id, private=args.private, exist_ok=True, repo_type="model")
            api.upload_folder(folder_path=folder, repo_id=args.repo_id, repo_type="model",
                              commit_message=args.commit_message,
                              ignore_patterns=HUB_IGNORE + ["*.bin", ".git/*"])
        except Exception as error:  # network, auth, permission: say what happened, upload nothing further
            print(f"error: upload to {args.repo_id} failed ({type(error).__name__}: {error}). Check the network and "
                  "your token (`hf auth login` or HF_TOKEN).", file=sys.stderr)
            return 2
        print(f"uploaded {folder} to {url}")
    except (ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
