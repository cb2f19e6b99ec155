"""The applications behind examples/ and their building blocks; not the model's remote code (nothing in
modeling_brillm.py imports this subpackage). `BriLLMSFTTrainer` (sft.py) imports trl, so only when asked for."""


def __getattr__(name):
    if name == "BriLLMSFTTrainer":
        from .sft import BriLLMSFTTrainer
        return BriLLMSFTTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
