"""lean_tp: fast, exact decode attention (LeanAttention, stream-K) for LLM inference."""

from lean_tp.ops import decode_attention, merge_attention

__version__ = "0.1.0"
__all__ = ["decode_attention", "merge_attention", "__version__"]
