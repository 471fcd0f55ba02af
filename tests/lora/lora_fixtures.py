"""PEFT adapters on tiny random transformers Qwen3.5 models (tests/hf_fixtures.py), saved with
PEFT's own save_pretrained, and engines that serve them."""

from __future__ import annotations

from pathlib import Path

import torch

from bi_core.lora.synthetic import random_adapter  # noqa: F401 (the tests import it from here)

DENSE_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                 "out_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(hf_model, path: Path, *, r: int = 8, alpha: float = 16.0, seed: int = 1, rslora: bool = False,
                 targets: list[str] | None = None, rank_pattern: dict | None = None, params: list[str] | None = None,
                 scale: float = 0.3):
    """A PEFT LoRA on ``hf_model`` with random A and B (PEFT starts B at zero), saved to ``path``;
    returns the PeftModel. ``params``: PEFT's ``target_parameters`` (the MoE experts' fused ones)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=DENSE_TARGETS if targets is None else targets,
                     lora_dropout=0.0, use_rslora=rslora, rank_pattern=rank_pattern or {}, target_parameters=params)
    peft_model = get_peft_model(hf_model, cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(str(path))
    return peft_model.eval()


def engine_config(ckpt: Path, adapters: dict[str, str] | None = None, *, max_loras: int = 4, max_rank: int = 16,
                  backend: str = "reference", dtype: str = "float32", experts: bool = False, **extra) -> dict:
    cfg = {"model": {"path": str(ckpt), "dtype": dtype, "device": "cpu"}, "backend": backend,
           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 128},
           "cache": {"block_size": 16, "num_blocks": 128},
           "lora": {"max_loras": max_loras, "max_rank": max_rank, "adapters": adapters or {}, "experts": experts}}
    cfg.update(extra)
    return cfg


def save_adapter(path: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """An adapter directory as PEFT's save_pretrained lays it out."""
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    return path
