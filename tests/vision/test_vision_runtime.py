"""Images through the runtime (reference backend, float32): the encoder runs once per request
however many chunks its prompt takes; the prefix cache hits a repeated image and never another
image behind the same placeholder ids; MTP emits AR's tokens on an image prompt; exact scoring
of an image prompt's continuation gives the logprobs generation reported."""

from __future__ import annotations

import random

import pytest
import torch
from vl_fixtures import IDS, make_hf_vl_model, random_pixels, save_with_mtp

from bi_core import EngineConfig, SamplingParams, build_engine

IMG, VS, VE = IDS["image_token_id"], IDS["vision_start_token_id"], IDS["vision_end_token_id"]
GRID = (1, 8, 8)  # 16 vision tokens
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = make_hf_vl_model(seed=2)
    return hf, save_with_mtp(hf, tmp_path_factory.mktemp("vl") / "ckpt")


def engine_for(path, strategy=None, chunk=16, prefix=False, graphs=False, **over):
    cfg = {"model": {"path": str(path), "dtype": "float32", "device": "cpu"}, "backend": "reference",
           "scheduler": {"max_num_seqs": 8, "max_num_batched_tokens": 256, "prefill_chunk_size": chunk},
           "cache": {"block_size": 16, "num_blocks": 128, "prefix_caching": prefix}}
    if graphs:  # graph steps rerun on their static buffers (no capture off a GPU): the graph path's planning
        cfg["graph"] = {"enabled": True, "capture": False}
    for k, v in over.items():
        cfg.setdefault(k, {}).update(v)
    if strategy == "mtp":
        cfg["strategy"] = {"name": "mtp", "num_speculative_tokens": 3}
    return build_engine(EngineConfig.from_dict(cfg))


def image(hf, seed):
    return {"pixel_values": random_pixels([GRID], hf, seed=seed), "grid_thw": GRID}


PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, VS, IMG, VE] + list(range(30, 60))


def count_tower_calls(eng) -> list:
    calls = []
    tower = eng.runner.vision
    forward = tower.forward

    def counted(pixels, grids):
        calls.append(list(grids))
        return forward(pixels, grids)

    tower.forward = counted
    return calls


def test_encoder_runs_once_per_request_across_chunks(checkpoint):
    hf, path = checkpoint
    whole = engine_for(path, chunk=128).generate(PROMPT, PARAMS, images=[image(hf, 1)])[0]
    eng = engine_for(path, chunk=16)  # the image's 16 tokens straddle chunks 2 and 3 of 5
    calls = count_tower_calls(eng)
    out = eng.generate(PROMPT, PARAMS, images=[image(hf, 1)])[0]
    assert calls == [[GRID]]
    assert out.token_ids == whole.token_ids
    torch.testing.assert_close(torch.tensor(out.token_logprobs), torch.tensor(whole.token_logprobs), atol=1e-5,
                               rtol=0)


def test_two_requests_encode_image_by_image(checkpoint):
    """One tower call an image (its rows never depend on the images encoded beside it)."""
    hf, path = checkpoint
    eng = engine_for(path, chunk=128)
    calls = count_tower_calls(eng)
    eng.generate([PROMPT, PROMPT], PARAMS, images=[[image(hf, 1)], [image(hf, 2)]])
    assert calls == [[GRID], [GRID]]


def test_prefix_cache_hits_a_repeated_image_and_never_another(checkpoint):
    hf, path = checkpoint
    cold = {s: engine_for(path).generate(PROMPT, PARAMS, images=[image(hf, s)])[0] for s in (1, 2)}
    eng = engine_for(path, prefix=True)
    first = eng.generate(PROMPT, PARAMS, images=[image(hf, 1)])[0]
    again = eng.generate(PROMPT, PARAMS, images=[image(hf, 1)])[0]
    other = eng.generate(PROMPT, PARAMS, images=[image(hf, 2)])[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 32  # past the image
    # the same placeholder ids, another image: only the text before the image may come from the cache
    assert other.num_cached_tokens <= PROMPT.index(IMG)
    assert other.token_ids == cold[2].token_ids != cold[1].token_ids
    assert again.token_ids == first.token_ids == cold[1].token_ids


def test_prefix_cache_negative_control(checkpoint, monkeypatch):
    """Keyed by the placeholder ids alone, the other image would hit the first one's pages."""
    from bi_core.runtime.sequence import Sequence

    hf, path = checkpoint
    monkeypatch.setattr(Sequence, "cache_ids", property(lambda self: self.all_ids))
    eng = engine_for(path, prefix=True)
    eng.generate(PROMPT, PARAMS, images=[image(hf, 1)])
    other = eng.generate(PROMPT, PARAMS, images=[image(hf, 2)])[0]
    assert other.num_cached_tokens > PROMPT.index(IMG)


@pytest.mark.parametrize("kind", ["model", "none", "partial"])
def test_mtp_equals_ar_on_an_image_prompt(checkpoint, kind):
    hf, path = checkpoint
    imgs = [[image(hf, 1)], [image(hf, 3)]]
    ar = engine_for(path).generate([PROMPT, PROMPT[:25]], PARAMS, images=imgs)
    eng = engine_for(path, "mtp")
    if kind != "model":  # forced drafts: wrong from a random point (none: all wrong)
        rng, truth = random.Random(3), {i: o.token_ids for i, o in enumerate(ar)}

        def hook(seq, proposed):
            right = truth[seq.request_id][len(seq.output_ids): len(seq.output_ids) + 3]
            cut = 0 if kind == "none" else rng.randint(0, len(right))
            return right[:cut] + [(t + 1) % 300 for t in right[cut:]]

        eng.strategy.draft_hook = hook
    out = eng.generate([PROMPT, PROMPT[:25]], PARAMS, images=imgs)
    for a, m in zip(ar, out):
        assert m.token_ids == a.token_ids and m.num_draft_tokens > 0
        torch.testing.assert_close(torch.tensor(m.token_logprobs), torch.tensor(a.token_logprobs), atol=1e-5,
                                   rtol=0)


def test_exact_scoring_of_an_image_prompt(checkpoint):
    hf, path = checkpoint
    eng = engine_for(path)
    gen = eng.generate(PROMPT, PARAMS, images=[image(hf, 1)])[0]
    scored = eng.score(PROMPT, gen.token_ids, exact=True, images=[image(hf, 1)])[0]
    torch.testing.assert_close(torch.tensor(scored.token_logprobs), torch.tensor(gen.token_logprobs), atol=1e-5,
                               rtol=0)
    other = eng.score(PROMPT, gen.token_ids, exact=True, images=[image(hf, 2)])[0]
    assert not torch.allclose(torch.tensor(other.token_logprobs), torch.tensor(gen.token_logprobs), atol=1e-3)


def mrope_everywhere(monkeypatch):
    """Every step with an image request on the M-RoPE path (eager), as before its decode rows took the 1-D one."""
    from bi_core.runtime import batch

    multimodal = batch._multimodal

    def forced(token_ids, past_lens, mm, shift):
        out = multimodal(token_ids, past_lens, mm, shift)
        if "flat" in out:
            return {"rope_positions": [list(out["flat"]) for _ in range(3)], "embed_rows": [], "embeds": []}
        return out

    monkeypatch.setattr(batch, "_multimodal", forced)


def graphed_steps(eng) -> list:
    """(graph key or None, sequences' output lengths) of every main-model step."""
    seen, execute = [], eng.runner.execute

    def recorded(fwd):
        out = execute(fwd)
        if fwd.head == "model":
            seen.append((out.graph.key if out.graph is not None else None, [len(r.seq.output_ids) for r in fwd.rows]))
        return out

    eng.runner.execute = recorded
    return seen


def chain_slots(eng) -> list:
    """(KV slot, the slot of its row's index) of the image request's row in each head step the
    draft chain moves on the device (``advance``)."""
    seen, graphs = [], eng.runner.mtp_graphs
    advance = graphs.advance

    def recorded(ctx):
        nxt = advance(ctx)
        index, bs = nxt.context_lens_host[0] - 1, nxt.block_size
        seen.append((int(nxt.slot_mapping[0]), nxt.block_tables_host[0][index // bs] * bs + index % bs))
        return nxt

    graphs.advance = recorded
    return seen


@pytest.mark.parametrize("strategy", [None, "mtp"])
def test_image_requests_decode_steps_are_graphed_with_the_eager_mrope_bits(checkpoint, monkeypatch, strategy):
    """Decode (AR) and verify (MTP) steps of an image request replay the uniform graphs, at the
    shifted 1-D positions: the tokens and logprobs of eager M-RoPE steps, bitwise (one sequence:
    no padding row beside it)."""
    hf, path = checkpoint
    eng = engine_for(path, strategy, chunk=128, graphs=True)
    steps, chain = graphed_steps(eng), chain_slots(eng) if strategy else None
    out = eng.generate(PROMPT, PARAMS, images=[image(hf, 1)])[0]
    if chain is not None:  # the head's draft chain moved its rows on the device: KV slots at their indices
        assert chain and all(got == want for got, want in chain), chain
    decode = [key for key, lens in steps if lens[0] > 0]
    q = 1 if strategy is None else 4
    assert decode and all(key == (q, 1) for key in decode), steps
    assert eng.runner.main_graphs.num_replays[q] == len(decode)
    with monkeypatch.context() as m:
        mrope_everywhere(m)
        ref_eng = engine_for(path, strategy, chunk=128)
        ref_steps = graphed_steps(ref_eng)
        ref = ref_eng.generate(PROMPT, PARAMS, images=[image(hf, 1)])[0]
        assert all(key is None for key, _ in ref_steps)
        mrope_graphs = engine_for(path, strategy, chunk=128, graphs=True)
        mrope_graphs.generate(PROMPT, PARAMS, images=[image(hf, 1)])
        assert mrope_graphs.runner.main_graphs.num_replays[q] == 0  # the M-RoPE path runs eagerly
    assert out.token_ids == ref.token_ids
    assert torch.equal(torch.tensor(out.token_logprobs), torch.tensor(ref.token_logprobs))
    assert (out.num_draft_tokens, out.num_accepted_draft_tokens) == (ref.num_draft_tokens, ref.num_accepted_draft_tokens)
    other = engine_for(path, strategy, chunk=128, graphs=True).generate(PROMPT, PARAMS, images=[image(hf, 2)])[0]
    assert other.token_logprobs != out.token_logprobs  # negative control: another image
