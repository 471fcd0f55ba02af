"""Where every tensor of a Hugging Face Qwen3.5 checkpoint goes in :class:`Qwen35Model`.

One map, used both to load a checkpoint and to update weights in place: for each (normalised)
checkpoint name, the parameter it fills and how (``Placement``). Fusions are placements into
parts of one parameter: ``q|k|v -> qkv_proj`` and ``qkv|z|b|a -> in_proj`` are row ranges,
``gate|up -> gate_up_proj`` too (an FP8 model keeps GDN ``b|a`` apart, in ``in_proj_ba``); experts go to ``w13[e]`` (gate rows, then up rows at the padded
width) and ``w2[e]``, from the fused layout (``experts.gate_up_proj [E, 2I, H]``, possibly stored
transposed) or the per-expert one (``experts.{e}.gate_proj.weight``), the shared expert to
expert E and its gate to row E of the router. Each placement also names the regions it covers,
so a load can check that every parameter was filled once, whichever layout the checkpoint used.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from bi_core.models.args import ModelArgs
from bi_core.quant.scheme import splits_gdn_in_proj

Index = tuple  # a tuple of ints and slices, applied as tensor[index]


@attrs.frozen
class Placement:
    """``param[dst] = tensor[src]`` for each ``(dst, src)`` piece; ``tensor`` has ``shape`` (or,
    with ``transposable``, dims 1 and 2 swapped: fused experts stored ``[E, in, out]``)."""

    param: str
    shape: tuple[int, ...]
    pieces: tuple[tuple[Index, Index], ...]
    regions: tuple[tuple, ...]  # what this placement fills, for the coverage check of a load
    transposable: bool = False
    expert_prefix: str | None = None  # fused experts: the prefix whose two tensors decide the layout


@attrs.frozen
class WeightMap:
    by_name: dict[str, Placement]
    required: dict[str, frozenset]  # per parameter, the regions a load must fill

    def placement(self, name: str) -> Placement | None:
        return self.by_name.get(name)


def _rows(start: int, stop: int) -> Index:
    return (slice(start, stop),)


ALL: Index = (slice(None),)


class _Builder:
    def __init__(self, args: ModelArgs) -> None:
        self.args = args
        self.by_name: dict[str, Placement] = {}
        self.required: dict[str, set] = {}

    def add(self, name: str, param: str, shape: tuple[int, ...], pieces, regions, required: bool = True,
            **kw) -> None:
        self.by_name[name] = Placement(param, tuple(shape), tuple(pieces), tuple(regions), **kw)
        if required:
            self.required.setdefault(param, set()).update(regions)

    def whole(self, name: str, param: str, shape: tuple[int, ...], required: bool = True) -> None:
        self.add(name, param, shape, [(ALL, ALL)], [(param,)], required=required)

    def concat(self, param: str, parts: Iterable[tuple[str, int]], width: int | None) -> None:
        """``param`` = rows of ``parts`` (name, rows) one after another; ``width``: their dim 1."""
        row = 0
        for name, rows in parts:
            shape = (rows,) if width is None else (rows, width)
            self.add(name, param, shape, [(_rows(row, row + rows), ALL)], [(param, name)])
            row += rows

    def layer(self, ours: str, hf: str, layer_type: str) -> None:
        a, h = self.args, self.args.hidden_size
        self.whole(f"{hf}.input_layernorm.weight", f"{ours}.input_layernorm.weight", (h,))
        self.whole(f"{hf}.post_attention_layernorm.weight", f"{ours}.post_attention_layernorm.weight", (h,))
        if layer_type == "full_attention":
            s, hq, hkv, d = f"{hf}.self_attn", a.num_attention_heads, a.num_key_value_heads, a.head_dim
            self.concat(f"{ours}.mixer.qkv_proj.weight", [(f"{s}.q_proj.weight", 2 * hq * d),
                                                          (f"{s}.k_proj.weight", hkv * d),
                                                          (f"{s}.v_proj.weight", hkv * d)], h)
            self.whole(f"{s}.o_proj.weight", f"{ours}.mixer.o_proj.weight", (h, hq * d))
            self.whole(f"{s}.q_norm.weight", f"{ours}.mixer.q_norm", (d,))
            self.whole(f"{s}.k_norm.weight", f"{ours}.mixer.k_norm", (d,))
            if a.kv_scales:  # compressed-tensors' kv_cache_scheme: one calibrated scale each, per layer
                mtp = ours.startswith("mtp.")  # the MTP head's may be absent (not calibrated): scale 1 there
                self.whole(f"{s}.k_scale", f"{ours}.mixer.k_scale", (1,), required=not mtp)
                self.whole(f"{s}.v_scale", f"{ours}.mixer.v_scale", (1,), required=not mtp)
        else:
            s, hv = f"{hf}.linear_attn", a.linear_num_value_heads
            head = [(f"{s}.in_proj_qkv.weight", a.conv_dim), (f"{s}.in_proj_z.weight", a.value_dim)]
            tail = [(f"{s}.in_proj_b.weight", hv), (f"{s}.in_proj_a.weight", hv)]
            if splits_gdn_in_proj(a.quantization):  # official FP8: b|a unquantized, a projection of their own
                self.concat(f"{ours}.mixer.in_proj.weight", head, h)
                self.concat(f"{ours}.mixer.in_proj_ba.weight", tail, h)
            else:
                self.concat(f"{ours}.mixer.in_proj.weight", head + tail, h)
            self.whole(f"{s}.conv1d.weight", f"{ours}.mixer.conv1d", (a.conv_dim, a.linear_conv_kernel_dim))
            self.whole(f"{s}.A_log", f"{ours}.mixer.A_log", (hv,))
            self.whole(f"{s}.dt_bias", f"{ours}.mixer.dt_bias", (hv,))
            self.whole(f"{s}.norm.weight", f"{ours}.mixer.norm_weight", (a.linear_value_head_dim,))
            self.whole(f"{s}.out_proj.weight", f"{ours}.mixer.out_proj.weight", (h, a.value_dim))
        m = f"{hf}.mlp"
        if a.is_moe:
            self.moe(f"{ours}.mlp", m)
        else:
            i = a.intermediate_size
            self.concat(f"{ours}.mlp.gate_up_proj.weight", [(f"{m}.gate_proj.weight", i), (f"{m}.up_proj.weight", i)], h)
            self.whole(f"{m}.down_proj.weight", f"{ours}.mlp.down_proj.weight", (h, i))

    def moe(self, ours: str, m: str) -> None:
        a, h = self.args, self.args.hidden_size
        e, inter, shared = a.num_experts, a.moe_intermediate_size, a.shared_expert_intermediate_size
        width = max(inter, shared)  # experts of other widths are zero-padded to this (``SparseMoE``)
        w13, w2 = f"{ours}.w13", f"{ours}.w2"
        gate_parts = [(f"{m}.gate.weight", e)] + ([(f"{m}.shared_expert_gate.weight", 1)] if shared else [])
        self.concat(f"{ours}.gate.weight", gate_parts, h)
        p = f"{m}.experts"
        # fused: all routed experts at once; regions per expert, so per-expert names cover the same
        self.add(f"{p}.gate_up_proj", w13, (e, 2 * inter, h),
                 [((slice(0, e), slice(0, inter)), (ALL[0], slice(0, inter))),
                  ((slice(0, e), slice(width, width + inter)), (ALL[0], slice(inter, 2 * inter)))],
                 [(w13, x, part) for x in range(e) for part in ("gate", "up")], transposable=True, expert_prefix=p)
        self.add(f"{p}.down_proj", w2, (e, h, inter), [((slice(0, e), ALL[0], slice(0, inter)), ALL)],
                 [(w2, x) for x in range(e)], transposable=True, expert_prefix=p)
        for x in range(e):
            self.expert(f"{p}.{x}", w13, w2, x, inter, width)
        if shared:
            self.expert(f"{m}.shared_expert", w13, w2, e, shared, width)

    def expert(self, prefix: str, w13: str, w2: str, x: int, inter: int, width: int) -> None:
        h = self.args.hidden_size
        self.add(f"{prefix}.gate_proj.weight", w13, (inter, h), [((x, slice(0, inter)), ALL)], [(w13, x, "gate")])
        self.add(f"{prefix}.up_proj.weight", w13, (inter, h), [((x, slice(width, width + inter)), ALL)],
                 [(w13, x, "up")])
        self.add(f"{prefix}.down_proj.weight", w2, (h, inter), [((x, ALL[0], slice(0, inter)), ALL)], [(w2, x)])


def weight_map(args: ModelArgs, with_mtp: bool) -> WeightMap:
    """The map for a model with ``args`` (and its MTP head when ``with_mtp``); names normalised
    (``model.*``, ``lm_head.*``, ``mtp.*``; see ``loader.normalise``)."""
    b = _Builder(args)
    h, v = args.hidden_size, args.vocab_size
    b.whole("model.embed_tokens.weight", "embed_tokens", (v, h))
    b.whole("model.norm.weight", "norm.weight", (h,))
    if not args.tie_word_embeddings:
        b.whole("lm_head.weight", "lm_head.weight", (v, h))
    for i, t in enumerate(args.layer_types):
        b.layer(f"layers.{i}", f"model.layers.{i}", t)
    if with_mtp:
        b.whole("mtp.fc.weight", "mtp.fc.weight", (h, 2 * h))
        for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            b.whole(f"mtp.{n}.weight", f"mtp.{n}.weight", (h,))
        b.layer("mtp.layer", "mtp.layers.0", "full_attention")
    return WeightMap(b.by_name, {k: frozenset(r) for k, r in b.required.items()})
