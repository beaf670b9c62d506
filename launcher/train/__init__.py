"""The built-in Transformer trainer (BERT masked-LM, GPT causal LM), run under torchrun.

``python -m launcher.train --job JOB.yaml`` (see ``__main__``); ``loop.train(job)`` from code.
Imports torch, the standard library, ``launcher.spec`` and ``launcher.metrics`` only; the
``hf`` extra (safetensors, tokenizers) and tqdm where Hugging Face folders or text are read,
lazily.
"""
