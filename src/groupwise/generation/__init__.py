"""prompts → completions. `Generator` is the protocol; `TransformersGenerator` wraps `model.generate`."""

from groupwise.generation.base import Generator, completion_masks, encode_prompts, is_conversational
from groupwise.generation.hf import TransformersGenerator

GENERATORS = {"transformers": TransformersGenerator}

__all__ = ["GENERATORS", "Generator", "TransformersGenerator", "completion_masks", "encode_prompts", "is_conversational"]
