"""The built-in Transformer trainer (BERT masked-LM, GPT causal LM), run under torchrun.

``python -m launcher.train --job JOB.yaml`` (see ``__main__``); ``loop.train(job)`` from code.
Imports torch, the standard library and, of the launcher, ``spec``, ``metrics``, ``errors`` and
``util`` only. The rest is optional: Triton (the kernels) when it imports; and, imported
only where they are used, the ``hf`` extra (safetensors, tokenizers) and tqdm for Hugging Face
folders and text, nvidia-ml-py for GPU samples, tabulate for profiles, torchao for fp8 and
flash-attn-4 for ``train.attention``.
"""
