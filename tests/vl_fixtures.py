"""Tiny random multimodal Qwen3.5 checkpoints (``Qwen3_5ForConditionalGeneration``, the official
layout: ``model.language_model.*``, ``model.visual.*``, ``lm_head``) made with transformers' own
classes, and random pixels in the processor's patch layout."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from hf_fixtures import LAYER_TYPES, TINY

VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
# placeholder ids inside the tiny vocabulary (the real ones are 248053..248057)
IDS = dict(image_token_id=290, video_token_id=291, vision_start_token_id=292, vision_end_token_id=293)


def make_hf_vl_model(seed: int = 0, **vision):
    """A transformers Qwen3.5 conditional-generation model (dense text part) with random fp32 weights."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(TINY, num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, intermediate_size=96,
                eos_token_id=299, model_type="qwen3_5_text")
    text["rope_parameters"] = dict(text["rope_parameters"], mrope_section=[2, 1, 1], mrope_interleaved=True)
    config = Qwen3_5Config(text_config=text, vision_config=dict(VISION, out_hidden_size=TINY["hidden_size"], **vision),
                           tie_word_embeddings=False, **IDS)
    model = Qwen3_5ForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=gen).log())
            elif p.dim() == 1:
                base = 1.0 if name.endswith(("linear_attn.norm.weight", "norm1.weight", "norm2.weight",
                                             "merger.norm.weight")) else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                fan_in = math.prod(p.shape[1:])
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))
    return model.eval()


def save_vl_checkpoint(model, path: Path) -> Path:
    model.save_pretrained(path)
    return path


def random_pixels(grids: list[tuple[int, int, int]], model, seed: int = 1) -> torch.Tensor:
    """``[sum t*h*w, C*T*P*P]`` pixels for patch grids ``grids``."""
    v = model.config.vision_config
    dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    n = sum(t * h * w for t, h, w in grids)
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


class _TextPart:
    """The text model of a conditional-generation model as ``hf_fixtures.mtp_tensors`` reads one."""

    def __init__(self, hf) -> None:
        self.config = hf.config.text_config
        self._sd = {"model." + k: v for k, v in hf.model.language_model.state_dict().items()}

    def state_dict(self):
        return self._sd


def save_with_mtp(hf, path: Path) -> Path:
    """``hf`` saved by transformers, plus random ``mtp.*`` tensors (one MTP layer) in a file of their own."""
    import json

    from hf_fixtures import mtp_tensors
    from safetensors.torch import save_file

    hf.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in mtp_tensors(_TextPart(hf), "per_expert").items()},
              str(path / "mtp.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return path


SPECIAL = {"<|image_pad|>": IDS["image_token_id"], "<|video_pad|>": IDS["video_token_id"],
           "<|vision_start|>": IDS["vision_start_token_id"], "<|vision_end|>": IDS["vision_end_token_id"], "<|im_start|>": 294, "<|im_end|>": 295, "<unk>": 296}
WORDS = ["what", "is", "this", "a", "cat", "user", "assistant", "system"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
            "<|im_start|>assistant")


def save_tokenizer(path) -> None:
    """A word-level tokenizer with the placeholder tokens at the tiny ids and a ChatML-like template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)} | SPECIAL
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   additional_special_tokens=[k for k in SPECIAL if k not in ("<unk>", "<|im_end|>")])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(str(path))
