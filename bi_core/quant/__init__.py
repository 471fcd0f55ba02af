"""Quantized weights: the block-wise FP8 (W8A8) format of the official Qwen3.5-*-FP8 releases.

``fp8``: the numerics (block quantization of weights, per-token-group quantization of activations,
the float32 W8A8 emulation the reference backend runs); ``scheme``: which projections are FP8
(read from a checkpoint's ``quantization_config`` or chosen by ``model.quantization: fp8``);
``params``: how a model holds FP8 weights and their scales (tensor-parallel shards included);
``placement``: how checkpoint tensors and their scales land in those parameters; ``sizing``: the
weight memory of a model in bf16 and FP8, and the GPUs it needs.
"""
