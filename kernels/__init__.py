"""Mojo attention kernels (kernels/mojo/) and their Python bindings.

The engine owns the attention interface and so the list of `--attention` choices
(mili.engine.engine_config.ATTENTION_CHOICES); services import `kernels.choice` only once they
load a model.
"""
