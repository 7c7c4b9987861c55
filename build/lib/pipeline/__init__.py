"""hiertx: a research pipeline for hierarchical Transformer dialogue models."""

__version__ = "0.1.0"
