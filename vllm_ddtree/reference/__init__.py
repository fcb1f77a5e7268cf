"""Plain-transformers reference decoder: the correctness oracle for every speculative path."""

from .decoder import GenerationResult, ReferenceDecoder, SamplingConfig, SpecConfig, process_logits

__all__ = ["GenerationResult", "ReferenceDecoder", "SamplingConfig", "SpecConfig", "process_logits"]
