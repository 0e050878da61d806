"""atom: a compact inference engine for Kimi-K3 / K3.1 with DSpark speculation."""

from atom.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams"]


def __getattr__(name: str):
    # The engine pulls in torch and transformers; resolve it only when asked for.
    if name in ("LLMEngine", "LLM"):
        from atom.model_engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'atom' has no attribute {name!r}")
