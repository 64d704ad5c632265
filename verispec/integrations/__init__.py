"""Doors into verispec from other tools: ``transformers`` (verispec's loop as a ``custom_generate``)."""
