"""BriLLMConfig follows transformers' conventions: it builds with no arguments (transformers calls
`config.__class__()` in save_pretrained, generate() and the repr), every field has a default, and what needs a
graph is checked where a model is built or loaded, with the same clear messages."""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

from modeling_brillm import BriLLMConfig, BriLLMForCausalLM, BriLLMModel, build_sparse_graph, configuration_brillm

ROOT = Path(__file__).resolve().parents[2]


def test_default_config_builds_and_round_trips(tmp_path):
    config = BriLLMConfig()
    assert (config.vocab_size, config.node_size, config.graph, config.num_edges) == (4000, 32, "sparse", None)
    again = BriLLMConfig.from_dict(config.to_dict())
    assert again.to_dict() == config.to_dict()
    assert json.loads(config.to_json_string()) == json.loads(again.to_json_string())
    assert json.loads(config.to_json_string(use_diff=True)) == json.loads(again.to_json_string(use_diff=True))
    text = repr(config)
    assert text.startswith("BriLLMConfig") and '"model_type": "brillm"' in text
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert isinstance(loaded, BriLLMConfig) and loaded.num_edges is None and loaded.vocab_size == 4000


def test_every_field_has_a_default():
    config = BriLLMConfig()
    for name in ("vocab_size", "node_size", "max_position_embeddings", "graph", "num_edges", "position_encoding",
                 "position_overflow", "initializer_range", "loss_type", "num_negatives", "negative_sampling",
                 "start_signal", "num_start_signals", "bos_token_id", "eos_token_id", "pad_token_id",
                 "unk_token_id", "use_cache"):
        assert hasattr(config, name), name
    dense = BriLLMConfig(graph="dense", vocab_size=6)
    assert dense.num_edges == 36 and dense.num_edge_rows == 37


def test_repr_and_diff_of_a_real_config():
    config = BriLLMConfig(vocab_size=50, num_edges=70, node_size=8, pad_token_id=0)
    diff = config.to_diff_dict()
    assert diff["num_edges"] == 70 and diff["node_size"] == 8 and diff["model_type"] == "brillm"
    assert '"num_edges": 70' in repr(config)


@pytest.mark.parametrize("fields, needle", [
    (dict(), "a sparse graph needs num_edges"),
    (dict(vocab_size=10), "a sparse graph needs num_edges"),
    (dict(vocab_size=10, num_edges=101), "num_edges=101 exceeds vocab_size**2=100"),
    (dict(vocab_size=4, graph="dense", num_edges=3), "a dense graph has vocab_size**2=16 edges"),
])
def test_a_model_needs_the_graph_size(fields, needle):
    config = BriLLMConfig(**fields)  # the config alone builds
    pattern = "Invalid BriLLMConfig: " + needle.replace("*", r"\*")
    with pytest.raises(ValueError, match=pattern):
        BriLLMForCausalLM(config)
    with pytest.raises(ValueError, match=pattern):
        BriLLMModel(config)
    with pytest.raises(ValueError, match=pattern):
        config.num_parameters_formula()


def test_fields_changed_after_building_are_checked_at_model_build():
    config = BriLLMConfig(vocab_size=6, graph="dense")
    config.vocab_size = 7  # num_edges still says 36
    with pytest.raises(ValueError, match="dense graph has vocab_size\\*\\*2=49 edges, got num_edges=36"):
        BriLLMForCausalLM(config)
    config = BriLLMConfig(vocab_size=6, graph="dense")
    config.node_size = 0
    with pytest.raises(ValueError, match="node_size must be a positive integer"):
        BriLLMForCausalLM(config)


def test_from_pretrained_of_a_folder_without_num_edges_names_the_problem(tmp_path):
    torch.manual_seed(0)
    seqs = [torch.randint(0, 8, (6,)) for _ in range(3)]
    BriLLMForCausalLM.from_token_sequences(seqs, vocab_size=8, node_size=4).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["num_edges"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a sparse graph needs num_edges"):
        AutoModelForCausalLM.from_pretrained(tmp_path)


def test_from_graph_refuses_what_it_cannot_build():
    torch.manual_seed(0)
    graph = build_sparse_graph([torch.randint(0, 8, (6,)) for _ in range(3)], 8)
    sparse = BriLLMConfig(vocab_size=8, num_edges=graph.num_edges, node_size=4)
    assert BriLLMForCausalLM.from_graph(graph, config=sparse).config.num_edges == graph.num_edges
    with pytest.raises(ValueError, match="a sparse config needs its graph"):
        BriLLMForCausalLM.from_graph(None, config=sparse)
    with pytest.raises(ValueError, match="either config or config fields"):
        BriLLMForCausalLM.from_graph(graph, config=sparse, node_size=8)
    with pytest.raises(TypeError, match="graph must be a BigramGraph"):
        BriLLMForCausalLM.from_graph([[0, 1]], node_size=4)


def test_errors_checkable_on_the_config_alone_still_fire_at_construction():
    for fields, needle in [
        (dict(graph="mesh"), "graph must be one of"),
        (dict(num_edges=0), "num_edges must be a positive integer"),
        (dict(num_edges=2.5), "num_edges must be a positive integer"),
        (dict(node_size=0), "node_size must be a positive integer"),
        (dict(vocab_size=10, pad_token_id=10), "pad_token_id=10"),
        (dict(vocab_size=10, loss_type="sampled", num_negatives=10), "num_negatives=10"),
        (dict(start_signal="uniform", num_start_signals=2), "needs start_signal='learned'"),
    ]:
        with pytest.raises(ValueError, match="Invalid BriLLMConfig: .*" + needle):
            BriLLMConfig(**fields)


# ------------------------------------------------------------------------------------------------- versions
def test_the_code_and_setup_cfg_name_the_same_transformers_floor():
    floors = runpy.run_path(str(ROOT / ".ci" / "floor_constraints.py"))["floors"](str(ROOT / "setup.cfg"))
    assert floors["transformers"] == configuration_brillm.MIN_TRANSFORMERS
    assert set(floors) >= {"torch", "transformers", "huggingface_hub", "tokenizers", "safetensors", "accelerate",
                           "datasets", "evaluate"}
    installed = tuple(int(p) for p in transformers.__version__.split(".")[:2])
    assert installed >= tuple(int(p) for p in configuration_brillm.MIN_TRANSFORMERS.split(".")[:2])


@pytest.mark.parametrize("stub, version", [
    ("__version__ = '5.3.0'\nclass PreTrainedConfig:\n    pass\n", "5.3.0"),  # 5.0-5.3: not a dataclass
    ("__version__ = '4.57.1'\nclass PretrainedConfig:\n    pass\n", "4.57.1"),  # 4.x: the old name
])
def test_older_transformers_get_a_clear_error(tmp_path, stub, version):
    # The configuration module is remote code too: imported alone, against a stand-in for an older transformers.
    (tmp_path / "transformers").mkdir()
    (tmp_path / "transformers" / "__init__.py").write_text(stub)
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('cfg', "
            f"{str(ROOT / 'modeling_brillm' / 'configuration_brillm.py')!r})\n"
            "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert f"BriLLM needs transformers>={configuration_brillm.MIN_TRANSFORMERS}" in proc.stderr
    assert f"this is transformers {version}: pip install -U" in proc.stderr
