"""Abstract op builders, one module per op family; backends implement them."""

from bi_core.ops.attention import AttentionBuilder, AttentionSpec
from bi_core.ops.base import OpBuilder, OpSpec
from bi_core.ops.collective import AllGatherBuilder, AllReduceBuilder, CollectiveSpec
from bi_core.ops.context import ForwardContext
from bi_core.ops.gdn import GdnBuilder, GdnSpec
from bi_core.ops.linear import LinearBuilder, LinearSpec
from bi_core.ops.lora import LoraBuilder, LoraSpec
from bi_core.ops.moe import MoEBuilder, MoESpec
from bi_core.ops.norm import NormBuilder, NormSpec
from bi_core.ops.sampling import SamplingBatch, SamplingBuilder, SamplingSpec
from bi_core.ops.topk import TopKBuilder, TopKSpec
from bi_core.ops.vision import LayerNormBuilder, LayerNormSpec, VisionAttentionBuilder, VisionAttentionSpec

__all__ = [
    "AllGatherBuilder", "AllReduceBuilder", "CollectiveSpec",
    "AttentionBuilder", "AttentionSpec", "ForwardContext", "GdnBuilder", "GdnSpec",
    "LinearBuilder", "LinearSpec", "LoraBuilder", "LoraSpec", "MoEBuilder", "MoESpec",
    "NormBuilder", "NormSpec", "OpBuilder", "OpSpec", "SamplingBatch", "SamplingBuilder",
    "SamplingSpec", "TopKBuilder", "TopKSpec", "LayerNormBuilder", "LayerNormSpec", "VisionAttentionBuilder",
    "VisionAttentionSpec",
]
