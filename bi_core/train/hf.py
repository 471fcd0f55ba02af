"""transformers' own Qwen3.5 with the policy's weights: the trainer most RL stacks run (its
forward with fla's kernels on a GPU), here the control that shows the train/rollout gap users
have without ``PolicyModel``."""

from __future__ import annotations

import torch


def to_transformers(policy, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """A ``Qwen3_5ForCausalLM`` (or ``Qwen3_5MoeForCausalLM``) holding ``policy``'s weights, on its
    device, in ``dtype`` (default: the policy's compute dtype), in eval mode."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers < 5.20 keeps it here
        from transformers.modeling_utils import no_init_weights
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig

    if policy._adapter is not None:
        raise ValueError("to_transformers: the policy trains a LoRA adapter; give transformers its base weights "
                         "(policy.base_state_dict()) and the adapter through PEFT (policy.save_adapter(dir), then "
                         "PeftModel.from_pretrained(model, dir))")
    args = policy.args
    fields = {k: v for k, v in args.to_hf_text_config().items() if k != "model_type"}
    cls, conf = (Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig) if args.is_moe else (Qwen3_5ForCausalLM,
                                                                                     Qwen3_5TextConfig)
    dtype = dtype or policy.dtype
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(policy.device), no_init_weights():  # the weights come from the policy
            model = cls(conf(**fields))
    finally:
        torch.set_default_dtype(previous)
    state = policy.state_dict()
    if args.tie_word_embeddings:
        state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(_in_layout(state, set(model.state_dict())), strict=True)
    return model.eval()


def _in_layout(state: dict[str, torch.Tensor], keys: set[str]) -> dict[str, torch.Tensor]:
    """The policy's fused experts split per expert where the installed transformers keeps them so."""
    out = {}
    for name, t in state.items():
        prefix, _, leaf = name.rpartition(".")
        if name in keys or leaf not in ("gate_up_proj", "down_proj") or not prefix.endswith(".experts"):
            out[name] = t
            continue
        for e in range(t.shape[0]):
            if leaf == "gate_up_proj":
                gate, up = t[e].chunk(2, dim=0)
                out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
            else:
                out[f"{prefix}.{e}.down_proj.weight"] = t[e]
    return out


def transformers_logprobs(model, prompts, completions, temperature: float = 1.0) -> list[torch.Tensor]:
    """Per sequence, transformers' logprob of each completion token (one forward per sequence)."""
    out = []
    device = next(model.parameters()).device
    for p, c in zip(prompts, completions):
        logits = model(torch.tensor([list(p) + list(c)], device=device)).logits[0, len(p) - 1:len(p) + len(c) - 1]
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        out.append(lp.gather(1, torch.tensor(c, device=device)[:, None])[:, 0])
    return out
