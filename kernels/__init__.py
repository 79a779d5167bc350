"""Mojo attention kernels (kernels/mojo/) and their Python bindings.

Importing this package is cheap (no torch): services read ATTENTION_CHOICES while parsing flags
and import `kernels.backend` only once they load a model.
"""

# --attention values; see kernels/choice.py select_kernels for what each means.
ATTENTION_CHOICES = ("auto", "mojo", "torch")
DEFAULT_ATTENTION = "auto"
