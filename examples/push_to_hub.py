"""Publish a saved BriLLM folder on the Hugging Face Hub.

    python examples/push_to_hub.py --model outputs/demo --repo_id your-name/brillm-demo [--private]
    python examples/push_to_hub.py --model outputs/demo --repo_id your-name/brillm-demo \
        --dataset wikimedia/wikipedia --metric perplexity=41.2 --dry_run

Steps: check the folder is Hub-ready (safetensors, config with auto_map, the model's code files, tokenizer,
generation_config.json); write a model card README.md when the folder has none (or with --rewrite_card); then
create the repo and upload the folder with `HfApi.upload_folder`. --dry_run stops before the network.
Needs a token (`hf auth login`, HF_TOKEN, or --token). Offline (HF_HUB_OFFLINE=1 or no network) it says so and
exits with code 2; nothing is uploaded. The code: `push_main` in modeling_brillm/training/publishing.py.
"""

import sys

from modeling_brillm.training.publishing import push_main

if __name__ == "__main__":
    sys.exit(push_main())
