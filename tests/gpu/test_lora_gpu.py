"""LoRA on the GPU, 35B-A3B shape at reduced depth: a request on its adapter gives the same tokens
and logprobs alone and among requests on 8 adapters (rank 16 and 64) and none, with CUDA graphs
(bitwise, invariant engine), with negative controls; graph replay equals eager; the kernels'
adapted logits against the reference backend's."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config

from bi_core import EngineConfig, SamplingParams, build_engine

sys.path.insert(0, str(Path(__file__).parents[1] / "lora"))
from lora_fixtures import random_adapter  # noqa: E402

pytestmark = pytest.mark.gpu
VOCAB = 248320
ADAPTERS = [(f"r{r}_{i}", r) for r in (16, 64) for i in range(4)]  # 8 adapters: 4 of rank 16, 4 of rank 64


def lora_config(backend="cuda_hopper_invariant", graphs=True, invariant=True, dtype="bfloat16", experts=False):
    return EngineConfig.from_dict(tiny_config(
        model={"random": {"preset": "qwen3.5-35b-a3b", "seed": 0, "num_hidden_layers": 4}, "dtype": dtype,
               "device": "cuda", "max_model_len": 2048},
        backend=backend, policy={"batch_invariant": invariant}, graph={"enabled": graphs, "warmup": False},
        scheduler={"max_num_seqs": 64, "max_num_batched_tokens": 4096}, cache={"num_blocks": 4096},
        lora={"max_loras": 8, "max_rank": 64, "experts": experts}))


def loaded(config, adapters=ADAPTERS):
    eng = build_engine(config)
    for seed, (name, r) in enumerate(adapters):
        cfg, tensors = random_adapter(eng, r=r, seed=seed, scale=1.0)
        eng.load_lora_adapter(name, tensors=tensors, config=cfg)
    return eng


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (m,), generator=g).tolist() for m in torch.randint(1, 200, (n,), generator=g)]


def run(eng, needle, lora, fillers, adapters=ADAPTERS):
    """The needle's (tokens, logprobs) on adapter ``lora`` among ``fillers`` on random adapters or none."""
    pick = random.Random(len(fillers))
    names = [None] + [name for name, _ in adapters]

    def params(name):
        return SamplingParams(max_new_tokens=16, temperature=0.7, seed=3, ignore_eos=True, logprobs=0, lora_name=name)
    for p in fillers[: len(fillers) // 2]:
        eng.add_request(p, params(pick.choice(names)))
    eng.step()  # fillers already running when the needle arrives
    n = eng.add_request(needle, params(lora))
    for p in fillers[len(fillers) // 2:]:
        eng.add_request(p, params(pick.choice(names)))
    while eng.scheduler.has_work():
        eng.step()
    return n.output_ids, n.token_logprobs


@pytest.mark.parametrize("lora", ["r16_0", "r64_3"])
def test_adapter_request_bitwise_alone_and_among_8_adapters(lora):
    """Negative controls: the needle on another adapter and on none differ (the adapter reaches
    the bits), and the default engine's needle moves with the batch somewhere."""
    needle = torch.randint(0, VOCAB, (1500,), generator=torch.Generator().manual_seed(9)).tolist()
    eng = loaded(lora_config())
    alone = run(eng, needle, lora, [])
    assert eng.runner.main_graphs.num_replays[1] > 0
    for n in (3, 17, 63):
        assert run(eng, needle, lora, prompts(n, seed=n)) == alone, n
    assert run(eng, needle, "r16_1", [])[1] != alone[1] and run(eng, needle, None, [])[1] != alone[1]
    default = loaded(lora_config("cuda_default", invariant=False))
    d_alone = run(default, needle, lora, [])
    assert any(run(default, needle, lora, prompts(n, seed=n)) != d_alone for n in (17, 63))


def test_expert_adapter_request_bitwise_alone_and_among_expert_adapters():
    """lora.experts: adapters on the routed experts and the shared expert as well (every module the
    engine adapts). Negative control: the needle's adapter without its expert tensors differs."""
    experts = [(f"e{i}", 16) for i in range(4)]
    needle = torch.randint(0, VOCAB, (700,), generator=torch.Generator().manual_seed(5)).tolist()
    eng = loaded(lora_config(experts=True), experts)
    cfg, tensors = random_adapter(eng, r=16, seed=0, scale=1.0)
    eng.load_lora_adapter("e0_attn", tensors={k: v for k, v in tensors.items() if ".mlp." not in k},
                          config={k: v for k, v in cfg.items() if k != "target_parameters"})
    alone = run(eng, needle, "e0", [], experts)
    assert eng.runner.main_graphs.num_replays[1] > 0
    for n in (5, 31):
        assert run(eng, needle, "e0", prompts(n, seed=n), experts) == alone, n
    assert run(eng, needle, "e0_attn", [], experts)[1] != alone[1]


def test_graph_replay_equals_eager_with_adapters():
    ps = prompts(13, seed=4)
    names = [None] + [name for name, _ in ADAPTERS]
    params = [SamplingParams(max_new_tokens=16, ignore_eos=True, lora_name=names[i % len(names)]) for i in range(13)]
    eager = loaded(lora_config(graphs=False)).generate(ps, params)
    eng = loaded(lora_config())
    graphed = eng.generate(ps, params)
    assert eng.runner.main_graphs.num_replays[1] > 0
    for a, b in zip(eager, graphed):
        assert a.token_ids == b.token_ids and a.token_logprobs == b.token_logprobs


@pytest.mark.parametrize("backend", ["cuda_default", "cuda_hopper_invariant"])
def test_adapted_logits_match_the_reference(backend):
    """First-step logits under adapters: the backend's error against the fp32 reference within
    twice the bf16 reference's own."""
    ps = prompts(6, seed=1)
    params = [SamplingParams(max_new_tokens=1, lora_name=ADAPTERS[i][0]) for i in range(6)]
    logits = {}
    for name, dtype in ((backend, "bfloat16"), ("reference", "bfloat16"), ("reference", "float32")):
        eng = loaded(lora_config(name, graphs=False, invariant=name == "cuda_hopper_invariant", dtype=dtype))
        eng.on_logits = lambda seqs, rows, key=(name, dtype): [
            logits.setdefault((key, s.request_id), r.float()) for s, r in zip(seqs, rows)]
        eng.generate(ps, params)
        del eng
    for i in range(len(ps)):
        t = logits[(("reference", "float32"), i)]
        ours = float((logits[((backend, "bfloat16"), i)] - t).norm() / t.norm())
        ref = float((logits[(("reference", "bfloat16"), i)] - t).norm() / t.norm())
        assert ours < max(2 * ref, 1e-2), (i, ours, ref)
