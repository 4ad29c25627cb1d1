"""vllm.sampling_params.StructuredOutputsParams, as far as the stand-in applies it: `regex` only (vLLM's other
constraints — json, choice, grammar, json_object, structural_tag — are refused, not ignored)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class StructuredOutputsParams:
    regex: str | None = None
    json: Any = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self):
        others = {k: v for k, v in vars(self).items() if k != "regex" and v is not None}
        if others or self.regex is None:
            raise NotImplementedError(f"the stand-in applies structured_outputs regex only, got {vars(self)}")
