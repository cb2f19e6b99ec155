"""Generate text with a saved BriLLM: BriLLM's own energy decoding, transformers' generate(), or the pipeline.

    python examples/generate.py --model outputs/demo --prompt "the cat" --max_new_tokens 30
    python examples/generate.py --model outputs/demo --prompt "the cat" --do_sample --temperature 0.8 --top_k 20
    python examples/generate.py --model outputs/demo --prompt "the cat" --show_path          # energy of every step
    python examples/generate.py --model outputs/demo --prompt "the cat" --num_beams 4 --num_return_sequences 2 \\
        --stop_strings "." --show_path                                    # energy beam search, a path per sequence
    python examples/generate.py --model outputs/demo --prompt "the" "a dog" --mode pipeline --stop "."
    python examples/generate.py --model outputs/demo --benchmark                             # tokens/s, both loops

Modes:
  energy    (default) `energy_generate`: the next node is the one whose incoming edge delivers the most energy;
            self-loops excluded as in the paper's release (--allow_self_loops to keep them). Records the energy path
            (of every returned sequence with beams). Greedy, sampling, beam search (--num_beams,
            --num_return_sequences, --length_penalty, --early_stopping) and stop strings (--stop_strings).
  generate  `model.generate()` (greedy, sampling, top-k/top-p, beams with --num_beams, stop strings).
  pipeline  `pipeline("text-generation")`.

An empty prompt starts from the tokenizer's BOS token; a prompt longer than the model's max_position_embeddings is an
error (exit code 2) and --max_new_tokens past it is lowered, with a note on stderr, unless the model reads past its
trained range (saved with config.position_overflow="extend", or --extend for this run). A stop string ends a sequence
at the token that completes it, in every mode. The code: modeling_brillm/training/generate_cli.py.
"""

import sys

from modeling_brillm.training.generate_cli import main

if __name__ == "__main__":
    sys.exit(main())
