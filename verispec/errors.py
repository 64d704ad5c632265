"""The one exception type verispec raises for bad input or unusable models.

The CLI prints these as a one-line message (no traceback); library users can catch
``VerispecError`` (a ``ValueError``) to handle every user-facing failure at once.
"""


class VerispecError(ValueError):
    """A user-facing error: bad arguments, an unusable model, or non-finite logits."""
