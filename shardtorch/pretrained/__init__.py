"""Hugging Face checkpoints read and written by slices: what ``ts.nn.from_pretrained``,
``ts.nn.from_config`` and ``save_pretrained`` do (docs/pretrained.md)."""
