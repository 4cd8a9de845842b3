"""Adapters for the training stacks people already use, over evendp's public face (optional
extras: ``evendp[hf]`` for :mod:`.transformers` and :mod:`.accelerate`, ``evendp[lightning]``,
``evendp[deepspeed]``). Importing this package imports none of those libraries.
"""

__all__: list[str] = []
