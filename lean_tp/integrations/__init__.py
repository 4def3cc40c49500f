"""Drop-in integrations: Hugging Face transformers (``transformers.py``) and DeepSpeed inference
(``deepspeed.py``). Each is imported on demand, so lean_tp needs neither package installed."""
