"""BriLLM for Hugging Face transformers. Importing this package registers the `brillm` model type with
AutoConfig, AutoModel and AutoModelForCausalLM, and marks the classes so `save_pretrained` ships their code."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_brillm import BriLLMConfig
from .decoding import EnergyGenerateOutput, energy_generate
from .evaluation import perplexity
from .graph import BigramGraph, build_sparse_graph, count_bigrams, graph_from_edges, merge_edges
from .interpretability import EnergyTrace, energy_trace, plot_energy_path
from .model_card import write_model_card
from .modeling_brillm import BriLLMForCausalLM, BriLLMModel, BriLLMPreTrainedModel, positional_encoding
from .selfcheck import report_checks  # noqa: F401  (registers the kernels' self-checks with ops)
from .state import BriLLMState

AutoConfig.register("brillm", BriLLMConfig, exist_ok=True)
AutoModel.register(BriLLMConfig, BriLLMModel, exist_ok=True)
AutoModelForCausalLM.register(BriLLMConfig, BriLLMForCausalLM, exist_ok=True)
BriLLMConfig.register_for_auto_class()
BriLLMModel.register_for_auto_class("AutoModel")
BriLLMForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "BriLLMConfig", "BriLLMModel", "BriLLMForCausalLM", "BriLLMPreTrainedModel", "BriLLMState", "BigramGraph",
    "build_sparse_graph", "count_bigrams", "graph_from_edges", "merge_edges", "positional_encoding", "energy_generate",
    "EnergyGenerateOutput", "energy_trace", "EnergyTrace", "plot_energy_path", "perplexity", "write_model_card",
]
