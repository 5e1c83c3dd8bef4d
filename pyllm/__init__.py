"""pyllm: a fast, small LLM inference engine."""

__version__ = "0.1.0"
