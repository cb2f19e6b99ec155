"""Low-rank edges (`--config_overrides edge_rank=2`, low_rank.py) through every way of training examples/pretrain.py:
one process, DDP and FSDP on two CPU processes, and `--edge_sharding source`. Each gives one process's losses at the
same global batch; the saved folders load and generate the same tokens; the recipe records the override, and a
preset's "model" section takes the field too."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from modeling_brillm.training.errors import UsageError
from modeling_brillm.training.presets import config_overrides, load_preset
from tests.training.test_pretrain import CPU2, CPU2_FSDP, TINY, corpus, losses, run  # noqa: F401 (a fixture)

LOW_RANK = [*TINY, "--config_overrides", "edge_rank=2", "--max_train_steps", "6", "--per_device_eval_batch_size", "4",
            "--seed", "3"]


def test_config_overrides_read_fields_and_refuse_others():
    assert config_overrides("edge_rank=2, start_signal=learned,position_recency=0.1") == {
        "edge_rank": 2, "start_signal": "learned", "position_recency": 0.1}
    with pytest.raises(UsageError, match=r"--config_overrides 'vocab_size=3': expected FIELD=VALUE with FIELD one of"):
        config_overrides("vocab_size=3")
    with pytest.raises(UsageError, match="expected FIELD=VALUE"):
        config_overrides("edge_rank")


def test_a_preset_may_set_any_config_field(tmp_path):
    path = tmp_path / "low_rank.json"
    path.write_text(json.dumps({"model": {"edge_rank": 4, "_why": {"edge_rank": "8x fewer edge parameters"}}}))
    assert load_preset(str(path))["model"] == {"edge_rank": 4}
    path.write_text(json.dumps({"model": {"num_edges": 4}}))
    with pytest.raises(UsageError, match=r"unknown model field\(s\) \['num_edges'\]"):
        load_preset(str(path))


@pytest.mark.slow
def test_low_rank_edges_train_alike_in_one_process_ddp_fsdp_and_source_sharding(corpus, tmp_path):  # noqa: F811
    from transformers import AutoModelForCausalLM, AutoTokenizer

    common = [*LOW_RANK, "--train_file", corpus]
    dense, sharded = ["--optimizer", "adamw"], ["--edge_sharding", "source"]  # each with its one-process twin
    runs = {"one": (None, dense, 4), "ddp": (CPU2, dense, 2), "fsdp": (CPU2_FSDP, dense, 2),
            "one_sparse": (None, [], 4), "sharded": (CPU2, sharded, 2)}
    for name, (launcher, extra, batch) in runs.items():
        run([*common, *extra, "--per_device_train_batch_size", batch, "--output_dir", tmp_path / name], launcher,
            timeout=300)
    for name, twin in (("ddp", "one"), ("fsdp", "one"), ("sharded", "one_sparse")):
        got, reference = losses(tmp_path / name), losses(tmp_path / twin)
        assert sorted(got) == sorted(reference) == list(range(1, 7)), name
        for step, loss in reference.items():
            assert got[step] == pytest.approx(loss, rel=1e-5, abs=0), (name, step, got[step], loss)
    recipe = json.loads((tmp_path / "one" / "recipe.json").read_text())
    rank = [(s["value"], s["rule"]) for s in recipe["settings"] if (s["section"], s["name"]) == ("model", "edge_rank")]
    assert rank == [(2, "flag --config_overrides")], rank
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "one")
    prompt = tokenizer("The cat sat", return_tensors="pt").input_ids
    generated = {}
    for name in runs:
        model = AutoModelForCausalLM.from_pretrained(Path(tmp_path / name)).eval()
        assert model.config.edge_rank == 2 and hasattr(model.base_model, "edge_a")
        with torch.no_grad():
            generated[name] = model.generate(prompt, max_new_tokens=5, do_sample=False).tolist()
    assert generated["ddp"] == generated["fsdp"] == generated["one"], generated
    assert generated["sharded"] == generated["one_sparse"], generated
