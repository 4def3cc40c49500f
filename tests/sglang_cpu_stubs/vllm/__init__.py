"""A stand-in for the one piece of vLLM SGLang's CPU model path imports (``tests/sglang_engine_worker.py``)."""
