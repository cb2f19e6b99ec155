"""Publish a saved BriLLM folder on the Hugging Face Hub: checked Hub-ready, a model card written where it has none,
uploaded (--dry_run stops before the network). The token comes from `hf auth login` or HF_TOKEN. The code: `push_main`
in modeling_brillm/training/publishing.py.

    python examples/push_to_hub.py --model outputs/demo --repo_id your-name/brillm-demo [--private] [--dry_run]
"""

import sys

from modeling_brillm.training.publishing import push_main

if __name__ == "__main__":
    sys.exit(push_main())
