"""Remote code, as a Hub user meets it: a saved folder loads, generates and saves again in a fresh process that
cannot import this package, with whatever transformers version is installed (CI runs this file on the floor
versions of setup.cfg and on the latest)."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from modeling_brillm import BriLLMForCausalLM

# The fresh process must not find the package, whether it is on PYTHONPATH or installed (editable or not).
BLOCK_PACKAGE = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name == "modeling_brillm" or name.startswith("modeling_brillm."):
            raise ImportError("modeling_brillm is hidden in this test")
sys.meta_path.insert(0, _Block())
try:
    import modeling_brillm
    raise SystemExit("modeling_brillm should not be importable here")
except ImportError:
    pass
"""

FRESH_PROCESS = """
import json, os, sys
import torch
import transformers
from transformers import AutoModelForCausalLM

source, target = sys.argv[1], sys.argv[2]
transformers.logging.set_verbosity_info()  # from_pretrained then prints the config's repr (to_diff_dict)
model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True)
assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
default = type(model.config)()  # what transformers does inside save_pretrained and generate()
assert default.num_edges is None and repr(default)
ids = torch.load("ids.pt")
first = model.generate(ids, max_new_tokens=5, do_sample=False)
model.save_pretrained(target)
again = AutoModelForCausalLM.from_pretrained(target, trust_remote_code=True)
second = again.generate(ids, max_new_tokens=5, do_sample=False)
assert torch.equal(first, second), (first, second)
print("RESULT " + json.dumps({"version": transformers.__version__, "generated": first.tolist(),
                              "files": sorted(os.listdir(target))}))
"""

# Set by `make test-floor` to the latest environment's Python (when .venv exists, as in CI): folders then also
# cross between the floor and the latest transformers, both ways, as Hub folders do.
OTHER_PYTHON = os.environ.get("BRILLM_OTHER_PYTHON")


def run_fresh(cwd, source, target, python=sys.executable):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_", "BRILLM_"))}
    env.update(HF_HOME=str(cwd / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([python, "-c", BLOCK_PACKAGE + textwrap.dedent(FRESH_PROCESS), source, target], cwd=cwd,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1][len("RESULT "):]), proc.stdout + proc.stderr


def saved_tiny(tmp_path):
    torch.manual_seed(0)
    seqs = [torch.randint(0, 12, (9,)) for _ in range(6)]
    model = BriLLMForCausalLM.from_token_sequences(seqs, vocab_size=12, node_size=6, eos_token_id=11)
    model.save_pretrained(tmp_path / "saved")
    ids = torch.stack(seqs[:2])[:, :3]
    torch.save(ids, tmp_path / "ids.pt")
    return model, model.generate(ids, max_new_tokens=5, do_sample=False).tolist()


def test_every_file_a_saved_model_carries_is_imported_by_its_two_entry_modules(tmp_path):
    """transformers 5.4 copies remote code one import deep from the auto_map's modules (the configuration and the
    model): a file only another carried file imports is missing from the loaded copy there."""
    import re

    saved_tiny(tmp_path)
    carried = {p.stem for p in (tmp_path / "saved").glob("*.py")}
    direct = set()
    for entry in ("modeling_brillm", "configuration_brillm"):
        text = (tmp_path / "saved" / f"{entry}.py").read_text(encoding="utf-8")
        direct |= set(re.findall(r"^\s*from\s+\.(\w+)\s+import", text, re.M)) | {entry}
    assert "count_prior" in carried and carried <= direct, sorted(carried - direct)


def test_saved_folder_loads_generates_and_saves_in_a_fresh_process(tmp_path):
    model, expected = saved_tiny(tmp_path)
    result, log = run_fresh(tmp_path, "saved", "resaved")
    assert "BriLLMConfig" in log  # the info log printed the config's repr
    assert result["version"] == transformers.__version__ and result["generated"] == expected
    # the re-saved folder is itself a remote-code folder
    assert {"config.json", "model.safetensors", "configuration_brillm.py", "modeling_brillm.py"} <= set(result["files"])
    config = json.loads((tmp_path / "resaved" / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"].endswith("modeling_brillm.BriLLMForCausalLM")
    assert config["num_edges"] == model.config.num_edges


@pytest.mark.skipif(not OTHER_PYTHON,
                    reason="needs BRILLM_OTHER_PYTHON, a Python with another transformers (make test-floor sets it)")
def test_folders_cross_between_transformers_versions(tmp_path):
    _, expected = saved_tiny(tmp_path)
    # saved here, loaded, generated and saved again by the other version, and that folder loaded here
    theirs, _ = run_fresh(tmp_path, "saved", "theirs", python=OTHER_PYTHON)
    ours, _ = run_fresh(tmp_path, "theirs", "ours")
    assert theirs["version"] != ours["version"] == transformers.__version__, (theirs["version"], ours["version"])
    assert theirs["generated"] == ours["generated"] == expected


def test_folders_saved_before_the_model_held_its_base_still_load(tmp_path):
    """Until BriLLMForCausalLM held a BriLLMModel (`brillm.*` weights), it was one and saved its weights without the
    prefix: such folders load here and through remote code, giving the same logits and generations."""
    from safetensors.torch import load_file, save_file

    model, expected = saved_tiny(tmp_path)
    weights = tmp_path / "saved" / "model.safetensors"
    tensors = load_file(weights)
    assert all(name.startswith("brillm.") for name in tensors)
    save_file({name[len("brillm."):]: t for name, t in tensors.items()}, weights, metadata={"format": "pt"})
    loaded = BriLLMForCausalLM.from_pretrained(tmp_path / "saved")
    ids = torch.load(tmp_path / "ids.pt")
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    result, _ = run_fresh(tmp_path, "saved", "resaved")
    assert result["generated"] == expected


TRAINS = """
import json, sys
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

source = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(source, trust_remote_code=True)
ids = torch.load("ids.pt")
rows = [{"input_ids": r, "labels": r} for r in ids]
args = TrainingArguments(output_dir="trainer", max_steps=6, per_device_train_batch_size=2, learning_rate=0.05,
                         report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True)
trainer = Trainer(model=model, args=args, train_dataset=rows)
trainer.train()
losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
trainer.save_model("trained")
again = AutoModelForCausalLM.from_pretrained("trained", trust_remote_code=True)
with torch.no_grad():
    same = torch.equal(model(ids).logits, again(ids).logits)
print("RESULT " + json.dumps({"losses": losses, "same": same, "module": type(model).__module__}))
"""


def test_a_saved_folder_trains_under_trainer_without_the_package(tmp_path):
    """A Hub user with transformers alone fine-tunes a saved folder with `Trainer` and saves it again."""
    torch.manual_seed(0)
    seqs = [torch.randint(0, 12, (9,)) for _ in range(8)]
    BriLLMForCausalLM.from_token_sequences(seqs, vocab_size=12, node_size=6).save_pretrained(tmp_path / "saved")
    torch.save(torch.stack(seqs), tmp_path / "ids.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "HF_", "TRANSFORMERS_", "BRILLM_"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", BLOCK_PACKAGE + textwrap.dedent(TRAINS), "saved"], cwd=tmp_path,
                          env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["module"].startswith("transformers_modules") and result["same"]
    assert len(result["losses"]) == 6 and result["losses"][-1] < result["losses"][0], result["losses"]
