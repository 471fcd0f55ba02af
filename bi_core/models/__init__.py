"""Qwen3.5 model definition, checkpoint loading, presets and tokenizers."""
