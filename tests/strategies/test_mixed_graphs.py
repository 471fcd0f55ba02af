"""Mixed graphs (``graph.mixed``, issue 22): a step of one-token decode rows plus one prompt piece
(a full chunk, or a prompt's last piece padded at its end) replays a graph of (1, bucket, chunk),
with padding decode rows between the real ones and the piece. On the CPU the graph runner reruns each step on its static buffers (``capture=False``)
against the reference backend: bucketing, the padded layout, the logits rows and the per-token
outputs mapped back must give eager's outputs."""

from __future__ import annotations

import attrs
import pytest
import torch
from helpers import reverse_prompt_piece_rows, tiny_config
from test_graph_steps import clear_scratch, scratch_written

from bi_core import EngineConfig, SamplingParams, build_engine
from bi_core.errors import ConfigError
from bi_core.runtime.batch import plan_batch
from bi_core.runtime.graphs import CudaGraphRunner
from bi_core.runtime.graphs.static_batch import lone_sizes, mixed_buckets
from bi_core.runtime.runner import mtp_graph_spec

CHUNK = 32


def config(preset: str, **extra) -> EngineConfig:
    # 3 short prompts fill the first step; the long ones then prefill in 32-token chunks beside
    # their decode rows, one chunk a step (the budget holds 8 decode rows + one chunk)
    return EngineConfig.from_dict(tiny_config(model={"random": {"preset": preset, "seed": 1},
                                                     "enable_return_routed_experts": preset == "tiny-moe"},
                                              scheduler={"prefill_chunk_size": CHUNK, "max_num_batched_tokens": 40},
                                              **extra))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    # 96 = 3 full chunks (its last chunk is full too: the graph's chunk logits row is asked for), 75 = 2 + 11
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 7, 6, 96, 75)]


def lone_prompt(n: int = 5) -> list[int]:
    """A prompt of a quarter chunk or less, run alone: its step replays the quarter-chunk graph."""
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(4)).tolist()


def with_mixed_runner(eng):
    clear_scratch(eng)
    spec = attrs.evolve(eng.runner.spec, use_graphs=True, prompt_chunk=eng.scheduler.chunk_size)
    eng.runner.main_graphs = CudaGraphRunner(attrs.evolve(spec, capture=False))
    return eng


PARAMS = {
    "greedy": SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1),
    "sampled": SamplingParams(max_new_tokens=12, temperature=0.9, seed=5, ignore_eos=True),
    "routed": SamplingParams(max_new_tokens=6, ignore_eos=True, return_routed_experts=True),
}


@pytest.mark.parametrize("preset,mode", [("tiny-dense", "greedy"), ("tiny-dense", "sampled"),
                                         ("tiny-moe", "sampled"), ("tiny-moe", "routed")])
def test_mixed_steps_replay_and_equal_eager(preset, mode):
    ps, params = prompts(), PARAMS[mode]
    eager = build_engine(config(preset)).generate(ps, params)
    eng = with_mixed_runner(build_engine(config(preset)))
    out = eng.generate(ps, params)
    graphs = eng.runner.main_graphs
    assert graphs.mixed_replays > 0 and any(len(k) == 3 and k[2] == CHUNK for k in graphs.graphs)
    assert scratch_written(eng)
    for a, b in zip(out, eager):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), atol=1e-5, rtol=1e-5)
        if mode == "greedy":  # the chunk's rows (hidden states) come back in the request's layout
            assert [sorted(d) for d in a.prompt_logprobs[1:]] == [sorted(d) for d in b.prompt_logprobs[1:]]
            torch.testing.assert_close(torch.tensor([v for d in a.prompt_logprobs[1:] for _, v in sorted(d.items())]),
                                       torch.tensor([v for d in b.prompt_logprobs[1:] for _, v in sorted(d.items())]),
                                       atol=1e-5, rtol=1e-5)
        if mode == "routed":  # every prompt token's experts, the chunk's rows past the padding included
            assert torch.equal(torch.as_tensor(a.routed_experts), torch.as_tensor(b.routed_experts))


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_a_lone_short_prompt_replays_the_quarter_chunk_graph(preset):
    """A prompt of at most a quarter chunk, alone, is padded to a quarter chunk, not a whole one;
    its outputs equal eager's (greedy, with prompt logprobs: every real row comes back)."""
    params = PARAMS["greedy"]
    eager = build_engine(config(preset)).generate([lone_prompt()], params)
    eng = with_mixed_runner(build_engine(config(preset)))
    out = eng.generate([lone_prompt()], params)
    graphs = eng.runner.main_graphs
    assert graphs.mixed_replays == 1 and (1, 0, CHUNK // 4) in graphs.graphs and (1, 0, CHUNK) not in graphs.graphs
    a, b = out[0], eager[0]
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor([v for d in a.prompt_logprobs[1:] for _, v in sorted(d.items())]),
                               torch.tensor([v for d in b.prompt_logprobs[1:] for _, v in sorted(d.items())]),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_a_lone_prompt_pads_to_the_next_size_of_its_ladder(preset):
    """A lone prompt longer than a quarter chunk pads to the next size of bucket 0's doubling
    ladder (``lone_sizes``: 12 tokens -> 16 rows, not the whole chunk of 32); outputs as eager's."""
    params = PARAMS["greedy"]
    eager = build_engine(config(preset)).generate([lone_prompt(12)], params)
    eng = with_mixed_runner(build_engine(config(preset)))
    out = eng.generate([lone_prompt(12)], params)
    graphs = eng.runner.main_graphs
    assert graphs.mixed_replays == 1 and (1, 0, 16) in graphs.graphs and (1, 0, CHUNK) not in graphs.graphs
    assert out[0].token_ids == eager[0].token_ids
    torch.testing.assert_close(torch.tensor(out[0].token_logprobs), torch.tensor(eager[0].token_logprobs),
                               atol=1e-5, rtol=1e-5)


def test_mixed_graph_keys():
    """(1, bucket of the decode rows, chunk) for one-token recurrent rows then one prompt piece of
    at most the chunk size (a prompt's last piece is padded at its end); two pieces, a piece not
    last or multi-token decode rows run eagerly."""
    eng = build_engine(config("tiny-dense"))
    runner = CudaGraphRunner(attrs.evolve(eng.runner.spec, use_graphs=True, prompt_chunk=CHUNK, capture=False))
    assert runner.mixed_buckets == mixed_buckets(8) == [0, 1, 2, 4, 8]
    assert mixed_buckets(72) == [0, 1, 2, 4, 8, 16, 32, 64, 72]

    def key(lens, recurrent):
        hb = plan_batch([[1] * q for q in lens], [40] * len(lens), [[0, 1, 2, 3, 4]] * len(lens),
                        list(range(len(lens))), recurrent, block_size=16)
        return runner.graph_key(hb)

    assert key([1, 1, 1, CHUNK], [True] * 3 + [False]) == (1, 4, CHUNK)
    assert key([CHUNK], [False]) == (1, 0, CHUNK)
    assert key([1] * 8 + [CHUNK], [True] * 8 + [False]) == (1, 8, CHUNK)
    assert key([1, 1, 1], [True] * 3) == (1, 4)  # uniform as before
    assert key([1, 1, 20], [True, True, False]) == (1, 2, CHUNK)  # a last (shorter) piece: padded at its end
    # a piece of at most a quarter chunk takes the quarter-chunk graph (mixed_sizes)
    assert runner.mixed_sizes == [CHUNK // 4, CHUNK]
    assert key([1, 1, CHUNK // 4], [True, True, False]) == (1, 2, CHUNK // 4)
    assert key([5], [False]) == (1, 0, CHUNK // 4)
    # a lone piece (bucket 0) pads to the next size of a doubling ladder (lone_sizes), a piece among
    # decode rows to a quarter chunk or the chunk
    assert runner.lone_sizes == lone_sizes(CHUNK) == [CHUNK // 4, CHUNK // 2, CHUNK]
    assert lone_sizes(3968) == [128, 256, 512, 1024, 2048, 3968]
    assert key([CHUNK // 4 + 1], [False]) == (1, 0, CHUNK // 2)
    assert key([1, CHUNK // 4 + 1], [True, False]) == (1, 1, CHUNK)
    assert key([1, 1, CHUNK // 4 + 1], [True, True, False]) == (1, 2, CHUNK)
    assert key([1, 1, CHUNK + 1], [True, True, False]) is None
    assert key([1, CHUNK, CHUNK], [True, False, False]) is None
    assert key([CHUNK, 1], [False, True]) is None
    assert key([2, 2, CHUNK], [True, True, False]) is None


def test_mixed_outputs_layout():
    """Padding sits between the decode rows and the chunk; ``spans`` and ``graph_rows`` map the
    request's rows there and back."""
    eng = build_engine(config("tiny-dense"))
    runner = CudaGraphRunner(attrs.evolve(eng.runner.spec, use_graphs=True, prompt_chunk=CHUNK, capture=False))
    hb = plan_batch([[7], [8], [9] * CHUNK], [10, 11, 0], [[0], [1], [2, 3]], [0, 1, 2], [True, True, False],
                    block_size=16, logits_rows=[[0], [0], [CHUNK - 1]])
    ids, ctx = runner.make_context(hb, torch.device("cpu"))
    assert ctx.graph.spans(3) == [(0, 2), (2, 2 + CHUNK)]  # bucket 2: no padding
    hb3 = plan_batch([[7], [8], [6], [9] * CHUNK], [10, 11, 12, 0], [[0], [1], [4], [2, 3]], [0, 1, 3, 2],
                     [True, True, True, False], block_size=16)
    ids, ctx = runner.make_context(hb3, torch.device("cpu"))
    static = runner.statics[(1, 4, CHUNK)]
    assert ctx.graph.spans(4) == [(0, 3), (4, 4 + CHUNK)]
    assert static.graph_rows(hb3, [0, 1, 2, 3 + CHUNK - 1]) == [0, 1, 2, 4 + CHUNK - 1]
    assert ctx.token_state_slots_host[3] == eng.runner.spec.scratch_slot  # the padding row
    assert ids[:3].tolist() == [7, 8, 6] and ids[3].item() == 0 and ids[4:].tolist() == [9] * CHUNK
    assert ctx.logits_indices.tolist() == [0, 1, 2, 3, 4 + CHUNK - 1]
    outs = (torch.arange(4 + CHUNK)[:, None].float(), torch.arange(5)[:, None].float())
    hidden, logits = static.outputs(outs)
    assert hidden[:, 0].tolist() == [0, 1, 2] + list(range(4, 4 + CHUNK))
    assert logits[:, 0].tolist() == [0, 1, 2, 4]  # the request asked for its rows 0, 1, 2 and the chunk's last


def test_mixed_graphs_config(monkeypatch):
    """auto: on where every attention impl can replay prompt rows and the strategy decodes one
    token a step; true where an impl cannot (the reference backend's reads host lists), with
    MTP or with graphs off: one ConfigError naming why."""
    from bi_core.backends.reference.attention import ReferenceAttentionImpl
    from bi_core.runtime.graphs.mode import mixed_graphs

    model = build_engine(config("tiny-dense")).model

    def resolve(query_lens=(1,), **graph):
        return mixed_graphs(config("tiny-dense", graph=graph), model, query_lens)

    assert not resolve(enabled=True) and not resolve(enabled=False)
    with pytest.raises(ConfigError, match="graph.mixed.*set graph.enabled: true"):  # a setting that would do nothing
        resolve(enabled=False, mixed=True)
    with pytest.raises(ConfigError, match="graph.mixed.*ReferenceAttentionImpl plans prompt rows on the host"):
        resolve(enabled=True, mixed=True)
    monkeypatch.setattr(ReferenceAttentionImpl, "graph_prompt_rows", True, raising=False)
    assert resolve(enabled=True) and resolve(enabled=True, mixed=True) and not resolve(enabled=True, mixed=False)
    assert not resolve((1, 4), enabled=True)
    with pytest.raises(ConfigError, match="graph.mixed.*decodes in steps of 4 tokens"):
        resolve((1, 4), enabled=True, mixed=True)


def test_mtp_gets_graphs_for_a_prompt_piece_alone(monkeypatch):
    """MTP's decode rows are 1+N tokens, so its mixed graphs hold a prompt piece alone (bucket 0):
    with ``graph.mixed`` auto where the attention can replay prompt rows; its outputs stay AR's
    (prompts alone and beside verify rows, which run eagerly)."""
    import random

    from test_mtp import config as mtp_config
    from test_mtp import hook_for

    from bi_core.backends.reference.attention import ReferenceAttentionImpl
    from bi_core.runtime.graphs.mode import mixed_fields

    model = build_engine(config("tiny-dense")).model
    cfg = config("tiny-dense", graph={"enabled": True})
    assert mixed_fields(cfg, model, (1, 4), CHUNK) == {"prompt_chunk": 0}  # the reference attention cannot
    monkeypatch.setattr(ReferenceAttentionImpl, "graph_prompt_rows", True, raising=False)
    assert mixed_fields(cfg, model, (1, 4), CHUNK) == {"prompt_chunk": CHUNK, "mixed_decode_rows": False}
    assert mixed_fields(cfg, model, (1,), CHUNK) == {"prompt_chunk": CHUNK}
    off = config("tiny-dense", graph={"enabled": True, "mixed": False})
    assert mixed_fields(off, model, (1, 4), CHUNK) == {"prompt_chunk": 0}

    ps = [lone_prompt(), prompts()[3]]  # 5 tokens, then 96 arriving beside the first one's verify rows
    params = PARAMS["greedy"]
    ar = build_engine(mtp_config("tiny-dense", "ar")).generate(ps, params)
    eng = build_engine(mtp_config("tiny-dense", "mtp"))
    clear_scratch(eng)
    spec = attrs.evolve(eng.runner.spec, use_graphs=True, prompt_chunk=eng.scheduler.chunk_size,
                        mixed_decode_rows=False)
    eng.runner.main_graphs = CudaGraphRunner(attrs.evolve(spec, capture=False))
    eng.runner.mtp_graphs = CudaGraphRunner(attrs.evolve(mtp_graph_spec(spec), capture=False))
    eng.strategy.draft_hook = hook_for("partial", {i: o.token_ids for i, o in enumerate(ar)}, random.Random(3))
    first = eng.add_request(ps[0], params)
    eng.step()  # the lone prompt: a bucket-0 mixed graph
    graphs = eng.runner.main_graphs
    assert graphs.mixed_buckets == [0] and graphs.mixed_replays == 1
    assert all(k[1] == 0 for k in graphs.graphs if len(k) == 3)
    second = eng.add_request(ps[1], params)
    while eng.scheduler.has_work():
        eng.step()
    assert [first.output_ids, second.output_ids] == [o.token_ids for o in ar]
    assert all(k[1] == 0 for k in graphs.graphs if len(k) == 3)  # never a mixed graph with decode rows
    assert eng.runner.mtp_graphs.mixed_replays >= 1  # the head's catch-up over the lone prompt


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe"])
def test_the_heads_catch_up_over_a_lone_prompt_replays_prompt_graphs(monkeypatch, preset):
    """Where MTP's prompt pieces replay graphs alone (bucket 0), the head's catch-up over each
    piece replays a head graph of the same size (``mtp_graph_spec``), the main model's hidden
    rows copied into its static input, the last piece padded at its end; launched behind the
    piece (its sample flying, ``MTPStrategy._behind_prompt``) or after the commit. Its drafts
    (every proposal, through the hook) are those of the head run eagerly, and the output stays
    AR's. Negative control: a head graph fed the piece's hidden rows in reverse order proposes
    other drafts, so the comparison sees the head's prompt rows."""
    import random

    from test_mtp import config as mtp_config
    from test_mtp import hook_for

    from bi_core.backends.reference.attention import ReferenceAttentionImpl

    monkeypatch.setattr(ReferenceAttentionImpl, "graph_prompt_rows", True, raising=False)
    ps = [prompts()[4]]  # 75 tokens: pieces of 32, 32 and 11 (padded to 16)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)  # sampled on the device: the piece's sample flies
    ar = build_engine(mtp_config(preset, "ar")).generate(ps, params)
    truth = {0: ar[0].token_ids}

    def proposals(head: str) -> tuple[list, int, list[int]]:
        eng = build_engine(mtp_config(preset, "mtp"))
        clear_scratch(eng)
        eng.overlap.behind = head == "graphs, behind"
        behind_prompt, launched = eng.strategy._behind_prompt, []
        eng.strategy._behind_prompt = lambda plan, out: launched.append(behind_prompt(plan, out)) or launched[-1]
        spec = attrs.evolve(eng.runner.spec, use_graphs=True, prompt_chunk=eng.scheduler.chunk_size,
                            mixed_decode_rows=False)
        eng.runner.main_graphs = CudaGraphRunner(attrs.evolve(spec, capture=False))
        mtp_spec = mtp_graph_spec(spec) if head != "eager" else attrs.evolve(spec, name="mtp", prompt_chunk=0)
        graphs = eng.runner.mtp_graphs = CudaGraphRunner(attrs.evolve(mtp_spec, capture=False))
        if head == "reversed rows":
            reverse_prompt_piece_rows(graphs)
        forced, seen = hook_for("partial", truth, random.Random(5)), []

        def hook(seq, proposed):
            seen.append((len(seq.output_ids), proposed))
            return forced(seq, proposed)
        eng.strategy.draft_hook = hook
        out = eng.generate(ps, params)
        assert launched == ([True] if head == "graphs, behind" else [])
        return seen, graphs.mixed_replays, out[0].token_ids

    eager, none, eager_tokens = proposals("eager")
    graphed, replays, graphed_tokens = proposals("graphs")
    assert none == 0 and replays == 3  # pieces 0 and 32 at the chunk's size, the last at 16 rows
    assert graphed_tokens == eager_tokens == truth[0]
    assert len(eager) > 3 and graphed == eager
    behind, replays, behind_tokens = proposals("graphs, behind")
    assert replays == 3 and behind_tokens == truth[0] and behind == eager
    wrong, _, wrong_tokens = proposals("reversed rows")
    assert wrong_tokens == truth[0]  # drafts never change the output...
    assert wrong != eager  # ...but these are not the head's drafts


def test_a_last_chunk_replayed_alone_is_not_launched_ahead_of():
    """A prompt of exactly one chunk, alone, sampled on the device: its step replays a mixed graph
    (bucket 0) whose rows all sample, but it is no decode step, so overlapped decode must not plan
    the next step from it (that plans every row one token on: the warm-up's first wave crashed)."""
    ps = [torch.randint(0, 256, (CHUNK,), generator=torch.Generator().manual_seed(1)).tolist()]
    params = PARAMS["sampled"]
    eager = build_engine(config("tiny-dense")).generate(ps, params)
    eng = with_mixed_runner(build_engine(config("tiny-dense")))
    assert [o.token_ids for o in eng.generate(ps, params)] == [o.token_ids for o in eager]
    assert eng.runner.main_graphs.mixed_replays == 1 and eng.num_ahead > 0  # the decode steps did fly


def test_a_last_piece_is_padded_at_its_end():
    """A prompt's last piece (r < chunk tokens) fills the chunk's first r rows; the rest are
    padding: KV on the scratch page, positions after it, its final-state slot, ``valid_tokens``
    r; its logits row is the last real one, an index filled per step."""
    eng = build_engine(config("tiny-dense"))
    spec = eng.runner.spec
    runner = CudaGraphRunner(attrs.evolve(spec, use_graphs=True, prompt_chunk=CHUNK, capture=False))
    r, past = 11, 64
    hb = plan_batch([[7], [8], [9] * r], [10, 11, past], [[0], [1], [2, 3, 4, 5, 6]], [0, 1, 2], [True, True, False],
                    block_size=16)
    ids, ctx = runner.make_context(hb, torch.device("cpu"))
    static = runner.statics[(1, 2, CHUNK)]
    assert ctx.query_lens_host == [1, 1, CHUNK] and ctx.valid_tokens_host == [1, 1, r]
    assert ctx.context_lens_host[-1] == past + CHUNK and ctx.valid_tokens.tolist() == [1, 1, r]
    assert ctx.positions.tolist()[2:] == list(range(past, past + CHUNK))
    page = spec.scratch_page
    assert ctx.slot_mapping.tolist()[2 + r:] == [page * 16 + i % 16 for i in range(CHUNK - r)]
    assert set(ctx.token_state_slots.tolist()[2 + r - 1:]) == {hb.token_state_slots[-1]}
    assert ctx.block_tables[2].tolist()[:6] == [2, 3, 4, 5, 6, page]  # positions past the pages: scratch
    assert ctx.block_tables.shape[1] == spec.max_blocks_per_seq + CHUNK // 16  # room for a piece padded past the end
    # a piece ending at the longest context still has its padding rows inside the table
    end = eng.runner.spec.max_blocks_per_seq * 16 - r
    pages = list(range(spec.max_blocks_per_seq))
    hb = plan_batch([[7], [8], [9] * r], [10, 11, end], [[0], [1], pages], [0, 1, 2], [True, True, False], block_size=16)
    ids, ctx = runner.make_context(hb, torch.device("cpu"))
    assert ctx.block_tables[2].tolist()[-(CHUNK // 16):] == [page] * (CHUNK // 16)
    assert ctx.logits_indices.tolist() == [0, 1, 2 + r - 1]
    assert ctx.graph.spans(3, r) == [(0, 2), (2, 2 + r)]
    outs = (torch.arange(2 + CHUNK)[:, None].float(), torch.arange(3)[:, None].float())
    hidden, logits = static.outputs(outs)
    assert hidden[:, 0].tolist() == list(range(2 + r)) and logits[:, 0].tolist() == [0, 1, 2]


@pytest.mark.parametrize("q,bucket,chunk", [(1, 1, 0), (1, 3, 0), (4, 1, 0), (1, 2, CHUNK), (1, 1, CHUNK)])
def test_static_buffers_start_16_byte_aligned(q, bucket, chunk):
    """Triton compiles a kernel variant per pointer alignment: a static field at an odd int64
    offset (a graph of 1 token, a mixed graph's logits rows) compiled every index-reading kernel a
    second time in a fresh start (benchmarks section 25)."""
    from bi_core.runtime.graphs import GraphRunnerSpec
    from bi_core.runtime.graphs.static_batch import StaticBatch

    spec = GraphRunnerSpec(dtype=torch.float32, device=torch.device("cpu"), use_graphs=True, max_batch_size=8,
                           max_blocks_per_seq=4, prompt_chunk=chunk)
    static = StaticBatch(spec, q, bucket, 16, torch.device("cpu"), chunk=chunk)
    views = [static.input_ids] + [v for v in static.views.values() if v is not None]
    assert all(v.data_ptr() % 16 == 0 for v in views)
    assert [b - a for a, b in static.fields.values()][:4] == [bucket * q + chunk] * 4
    # negative control: packed back to back (as before), some field of each shape starts at an odd offset
    sizes = [b - a for a, b in static.fields.values()]
    assert any(sum(sizes[:i]) % 2 for i in range(len(sizes)))
