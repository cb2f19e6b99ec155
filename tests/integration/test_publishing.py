"""Publishing: a saved BriLLM folder is Hub-ready (weights, remote code, tokenizer, generation config, model card)
and loads by repo id from the Hugging Face cache, offline, in a fresh process that cannot import the package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tiny import save_tiny
from huggingface_hub import ModelCard

from modeling_brillm.model_card import check_hub_ready, write_model_card

ROOT = Path(__file__).resolve().parents[2]
REPO_ID = "tiny-org/tiny-brillm"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_brillm_repo")
    model, tokenizer = save_tiny(directory)
    write_model_card(directory, model, tokenizer, datasets=["toy/animals"], metrics={"perplexity": 1.81},
                     repo_id=REPO_ID)
    return directory, model, tokenizer


def test_saved_folder_is_hub_ready(repo):
    directory, model, _ = repo
    files = set(os.listdir(directory))
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md", "configuration_brillm.py", "modeling_brillm.py"} <= files
    assert not any(f.endswith(".bin") for f in files)
    config = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == "brillm"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_brillm.BriLLMForCausalLM"
    assert config["auto_map"]["AutoConfig"] == "configuration_brillm.BriLLMConfig"
    generation = json.loads((directory / "generation_config.json").read_text())
    assert generation["eos_token_id"] == model.config.eos_token_id
    assert check_hub_ready(directory) == []


def test_model_card_metadata_and_usage(repo):
    directory, model, _ = repo
    card = ModelCard.load(directory / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers"
    assert data["pipeline_tag"] == "text-generation"
    assert "brillm" in data["tags"]
    assert data["datasets"] == ["toy/animals"] and data["metrics"] == ["perplexity"]
    result = data["model-index"][0]["results"][0]
    assert result["metrics"][0]["type"] == "perplexity" and result["metrics"][0]["value"] == 1.81
    text = card.text
    assert f'pipeline("text-generation", model="{REPO_ID}", trust_remote_code=True)' in text
    assert f'AutoModelForCausalLM.from_pretrained("{REPO_ID}", trust_remote_code=True)' in text
    assert "energy_generate" in text
    assert f"{model.config.vocab_size:,}" in text and f"{model.config.num_edges:,}" in text


def test_training_card_of_a_hub_dataset_run(tmp_path):
    """What examples/pretrain.py writes at its final save (the tiny end-to-end run in test_pretrain checks the
    local-file case): dataset ids in the metadata, the final perplexity in model-index, the run's facts."""
    from types import SimpleNamespace

    from modeling_brillm.training.publishing import data_facts, write_training_card

    model, tokenizer = save_tiny(tmp_path)
    args = SimpleNamespace(dataset_name="wikimedia/wikipedia", dataset_config_name="20231101.en", train_file=None,
                           validation_file=None, validation_split_percentage=5, block_size=32, block_mode="sentence",
                           optimizer="auto", learning_rate=0.05, lr_scheduler_type="linear", num_warmup_steps=10,
                           weight_decay=0.1)
    summary = {"steps": 150, "global_batch": 256, "train_tokens": 123456, "processes": 1, "perplexity": 12.3456789,
               "eval_loss": 2.5134, "perplexity_before": 600.0}
    write_training_card(tmp_path, model, tokenizer, args, summary, "Hub dataset wikimedia/wikipedia/20231101.en",
                        repo_id="me/brillm-wiki", optimizer="sparse_adamw")
    card = ModelCard.load(tmp_path / "README.md")
    data = card.data.to_dict()
    assert data["datasets"] == ["wikimedia/wikipedia"] and data["metrics"] == ["perplexity"]
    result = data["model-index"][0]["results"][0]
    assert result["dataset"] == {"name": "the dataset's validation split", "type": "wikimedia/wikipedia"}
    assert result["metrics"][0]["value"] == pytest.approx(12.3457)
    assert "| optimizer | sparse_adamw, lr 0.05 (linear, 10 warmup), weight decay 0.1 |" in card.text
    assert "| optimizer steps | 150 |" in card.text and "configuration `20231101.en`" in card.text
    assert 'model="me/brillm-wiki"' in card.text
    assert not list(tmp_path.glob("README.md.tmp-*"))  # written under a temporary name, then renamed
    # held-out texts and the built-in corpus are described, not given a dataset id
    args.dataset_name = None
    ids, text, held = data_facts(args, "the built-in corpus; every 20th text held out for validation")
    assert ids == [] and "pydoc_data" in text and held == "every 20th training text, held out"


def test_check_hub_ready_names_what_is_missing(repo, tmp_path):
    directory, _, _ = repo
    broken = tmp_path / "broken"
    shutil.copytree(directory, broken)
    for name in ("tokenizer.json", "tokenizer_config.json", "README.md", "energy.py"):
        (broken / name).unlink()
    (broken / "custom_generate").mkdir()
    problems = "\n".join(check_hub_ready(broken))
    assert "no tokenizer" in problems and "README.md" in problems and "energy.py" in problems
    assert "custom_generate" in problems


def place_in_hub_cache(folder: Path, hub_cache: Path, repo_id: str, commit: str = COMMIT) -> Path:
    """Lay `folder` out the way huggingface_hub caches a downloaded repo: models--ORG--NAME/refs/main holds the
    commit hash, snapshots/<hash>/ holds the files (as blobs/ + relative symlinks, like a real download)."""
    root = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    blobs = root / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    import hashlib

    for path in folder.iterdir():
        if path.is_file():
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            shutil.copyfile(path, blobs / digest)
            (snapshot / path.name).symlink_to(os.path.relpath(blobs / digest, snapshot))
    return snapshot


SUBPROCESS = r'''
import json, sys

class _Hide:
    """Meta-path finder that makes the installed (editable) BriLLM packages unimportable."""
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("modeling_brillm", "tokenization"):
            raise ModuleNotFoundError(f"No module named {name!r} (hidden for this test)", name=name)
        return None

sys.meta_path.insert(0, _Hide())
try:
    import modeling_brillm  # noqa: F401
except ModuleNotFoundError:
    pass
else:
    raise SystemExit("modeling_brillm is importable: the test would not prove anything")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

repo_id, prompt = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(repo_id, trust_remote_code=True)
# trust_remote_code here too (as the model card says): the tokenizer reads config.json, whose auto_map names code,
# and without it transformers asks on the terminal whether to run that code
tokenizer = AutoTokenizer.from_pretrained(repo_id, trust_remote_code=True)
ids = tokenizer(prompt, return_tensors="pt")
with torch.no_grad():
    logits = model(**ids).logits
generated = model.generate(**ids, max_new_tokens=8, do_sample=False)
pipe = pipeline("text-generation", model=repo_id, trust_remote_code=True)
text = pipe(prompt, max_new_tokens=8, do_sample=False)[0]["generated_text"]
try:  # a tool of the package, not of the saved code: said in one line
    energy = model.energy_generate(ids.input_ids, max_new_tokens=8).sequences[0].tolist()
except ImportError as error:
    energy = str(error)
print("RESULT " + json.dumps({
    "module": type(model).__module__,
    "pipe_module": type(pipe.model).__module__,
    "logits": logits[0].tolist(),
    "generated": generated[0].tolist(),
    "text": text,
    "energy": energy,
    "modeling_brillm_loaded": any(m.split(".")[0] == "modeling_brillm" for m in sys.modules),
}))
'''


def test_loads_from_hub_cache_offline_without_the_package(repo, tmp_path):
    directory, model, tokenizer = repo
    hf_home = tmp_path / "hf_home"
    place_in_hub_cache(directory, hf_home / "hub", REPO_ID)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "PYTHON", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_CACHE=str(hf_home / "hub"), HF_HUB_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"), OMP_NUM_THREADS="1",
               HF_HUB_DISABLE_TELEMETRY="1")
    prompt = "the cat"
    proc = subprocess.run([sys.executable, "-c", SUBPROCESS, REPO_ID, prompt], cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [text for text in proc.stdout.splitlines() if text.startswith("RESULT ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Do you wish to run the custom code" not in proc.stdout + proc.stderr
    result = json.loads(line[-1][len("RESULT "):])
    # the model's code came from the cached repo (remote code), not from the installed package
    assert result["module"].startswith("transformers_modules.") and not result["modeling_brillm_loaded"]
    assert result["pipe_module"].startswith("transformers_modules.")
    ids = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        expected_logits = model(**ids).logits[0]
    assert torch.allclose(torch.tensor(result["logits"]), expected_logits, atol=1e-5)
    expected = model.generate(**ids, max_new_tokens=8, do_sample=False)[0]
    assert result["generated"] == expected.tolist()
    assert result["text"] == tokenizer.decode(expected, skip_special_tokens=True)
    # energy_generate is a tool of the package, not of the saved code: without it, one line says how to get it
    assert "pip install brillm" in result["energy"] and "\n" not in result["energy"]


def push_main():
    from modeling_brillm.training.publishing import push_main  # what examples/push_to_hub.py runs

    return push_main


def test_push_to_hub_example_offline(repo, tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants

    main = push_main()
    directory, _, _ = repo
    folder = tmp_path / "to_push"
    shutil.copytree(directory, folder)
    (folder / "README.md").unlink()
    # dry run: writes the missing card, checks the folder, uploads nothing
    assert main(["--model", str(folder), "--repo_id", "someone/tiny", "--dry_run", "--dataset", "toy/animals",
                 "--metric", "perplexity=2.5"]) == 0
    assert "Hub-ready" in capsys.readouterr().out and (folder / "README.md").exists()
    card = ModelCard.load(folder / "README.md")
    assert card.data.to_dict()["datasets"] == ["toy/animals"] and "someone/tiny" in card.text
    # offline: a clear message and exit code 2, nothing attempted
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert main(["--model", str(folder), "--repo_id", "someone/tiny"]) == 2
    assert "offline" in capsys.readouterr().err
    # not a folder / not ready: exit code 2 naming the problem
    assert main(["--model", str(tmp_path / "nowhere"), "--repo_id", "someone/tiny"]) == 2
    assert "not a folder" in capsys.readouterr().err
    (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").unlink()
    assert main(["--model", str(folder), "--repo_id", "someone/tiny", "--dry_run"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --repo_id is required
        main(["--model", str(folder)])


def test_push_to_hub_example_reports_network_failure(repo, tmp_path, capsys, monkeypatch):
    """Online path with the Hub unreachable: the error is reported, not raised."""
    import huggingface_hub

    class Unreachable:
        def __init__(self, token=None):
            pass

        def create_repo(self, *args, **kwargs):
            raise ConnectionError("Name or service not known")

    monkeypatch.setattr(huggingface_hub, "HfApi", Unreachable)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    directory, _, _ = repo
    assert push_main()(["--model", str(directory), "--repo_id", "someone/tiny"]) == 2
    err = capsys.readouterr().err
    assert "upload to someone/tiny failed" in err and "ConnectionError" in err


def test_push_to_hub_example_leaves_training_checkpoints_out(repo, tmp_path, monkeypatch):
    """pretrain.py's `step_N` checkpoints (optimizer state, RNG) stay out of the upload; the model files go."""
    import huggingface_hub
    from huggingface_hub.utils import filter_repo_objects

    uploaded = {}

    class Recorder:
        def __init__(self, token=None):
            pass

        def create_repo(self, repo_id, **kwargs):
            return f"https://huggingface.co/{repo_id}"

        def upload_folder(self, folder_path, ignore_patterns, **kwargs):
            files = [str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file()]
            uploaded["files"] = set(filter_repo_objects(files, ignore_patterns=ignore_patterns))

    monkeypatch.setattr(huggingface_hub, "HfApi", Recorder)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    directory, _, _ = repo
    folder = tmp_path / "trained"
    shutil.copytree(directory, folder)
    (folder / "step_150").mkdir()
    (folder / "step_150" / "model.safetensors").write_bytes(b"checkpoint")
    (folder / "step_150" / "random_states_0.pkl").write_bytes(b"rng")
    assert push_main()(["--model", str(folder), "--repo_id", "someone/tiny"]) == 0
    assert "model.safetensors" in uploaded["files"] and "config.json" in uploaded["files"]
    assert not any(name.startswith("step_") for name in uploaded["files"])
