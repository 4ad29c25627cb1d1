"""prompts → completions. `Generator` is the protocol; `TransformersGenerator` wraps `model.generate`."""

from groupwise.generation.base import Generator, completion_masks, encode_prompts, is_conversational, trim_to_mask
from groupwise.generation.fast import FastGenerator
from groupwise.generation.hf import TransformersGenerator

# the one place a generation backend is chosen (GRPOConfig.generation_backend)
GENERATORS = {"transformers": TransformersGenerator, "fast": FastGenerator}

__all__ = ["GENERATORS", "FastGenerator", "Generator", "TransformersGenerator", "completion_masks", "encode_prompts",
           "is_conversational", "trim_to_mask"]
