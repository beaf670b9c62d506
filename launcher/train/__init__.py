"""The built-in Transformer trainer (BERT masked LM, GPT causal LM), run under torchrun.

Imports torch, the standard library and, of the launcher, ``spec``, ``metrics``, ``errors``
and ``util`` only; optional packages only where they are used.
"""
