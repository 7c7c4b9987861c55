"""Response generation for every seq2seq model: ``generate(model, batch, DecodeConfig)``."""

from pipeline.decode.generate import (
    Beams,
    DecodeConfig,
    GenerationOutput,
    generate,
    length_penalty,
)

__all__ = ["Beams", "DecodeConfig", "GenerationOutput", "generate", "length_penalty"]
