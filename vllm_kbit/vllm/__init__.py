"""vLLM integration: the ``kbit`` quantization config and its linear / FusedMoE methods (imports vLLM)."""
