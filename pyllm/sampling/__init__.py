"""Sampling: from logits to tokens, and from tokens back to text as it streams."""

from pyllm.sampling.detokenizer import IncrementalDetokenizer

__all__ = ["IncrementalDetokenizer"]
