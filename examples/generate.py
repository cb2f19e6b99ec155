"""Generate text with a saved BriLLM: its own energy decoding (the default; `--show_path` prints every step's energy
and rank), transformers' generate() or the pipeline. The code: modeling_brillm/training/generate_cli.py.

    python examples/generate.py --model outputs/demo --prompt "the cat" --max_new_tokens 30 --show_path
    python examples/generate.py --model outputs/demo --prompt "the cat" --num_beams 4 --num_return_sequences 2
    python examples/generate.py --model outputs/demo --prompt "the" "a dog" --mode pipeline --stop "."
"""

import sys

try:
    from modeling_brillm.training.generate_cli import main
except ImportError as err:  # never a folder's own code in its place: whether to run that is the user's choice
    print(f"error: examples/generate.py runs on the modeling_brillm package ({err}): `pip install -e .` in the "
          "repository. A saved folder's own code loads without it: AutoModelForCausalLM.from_pretrained(folder, "
          "trust_remote_code=True), if you trust that code.", file=sys.stderr)
    sys.exit(2)

if __name__ == "__main__":
    sys.exit(main())
