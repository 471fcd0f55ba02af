"""How a config's steps are launched (``graph.*`` and the device, not an op the policy selects):
eager steps when graphs are off; CUDA graphs on a CUDA device; graph steps rerun on their static
buffers without capture where nothing can be captured (``graph.capture``). And the mixed-step
fields of the graph runner's spec (``graph.mixed``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from bi_core.config import EngineConfig, GraphConfig
from bi_core.errors import ConfigError
from bi_core.runtime.graphs.spec import GraphRunnerSpec


def capture_refusals(backends: Iterable[object]) -> dict[str, str]:
    """Backend name -> why a CUDA graph cannot capture its impls, for each of ``backends`` (those
    serving the model's ops) that declares a reason (``Backend.graph_capture_refusal``)."""
    return {b.name: b.graph_capture_refusal for b in backends if b.graph_capture_refusal is not None}


def resolve_capture(graph: GraphConfig, device: torch.device, refusals: dict[str, str]) -> bool:
    """Whether graph steps are captured as CUDA graphs (else rerun on their static buffers);
    raises for a ``graph.capture`` that cannot hold or would do nothing."""
    if not graph.enabled:
        if graph.capture != "auto":
            raise ConfigError("graph.capture", f"{str(graph.capture).lower()} would do nothing: it says how graph "
                              "steps run, and graph.enabled is false; set graph.enabled: true, or leave "
                              "graph.capture at auto")
        return False
    if graph.capture is False:
        return False
    if device.type != "cuda":
        if graph.capture is True:
            raise ConfigError("graph.capture", f"CUDA graphs need a CUDA device; model.device resolves to {device}: "
                              "use auto (graph steps rerun without capture there) or false")
        return False
    if refusals:
        key = "graph.capture" if graph.capture is True else "graph.enabled"
        why = "; ".join(f"backend {name!r}: {reason}" for name, reason in sorted(refusals.items()))
        raise ConfigError(key, f"CUDA graphs cannot capture this model's impls ({why}); set graph.capture: false "
                          "(graph steps rerun on their static buffers, not captured) or graph.enabled: false")
    return True


def explain_line(spec: GraphRunnerSpec) -> str:
    """One line for ``bi-engine explain``: how the main model's steps are launched."""
    if not spec.use_graphs:
        return "graphs: eager steps (graph.enabled: false)"
    mixed = "; mixed steps too" if spec.prompt_chunk and spec.mixed_decode_rows else \
        "; a lone prompt's pieces too" if spec.prompt_chunk else ""
    how = "CUDA graphs, captured" if spec.capture else "graph steps rerun on their static buffers, not captured"
    return (f"graphs: {how}, per batch bucket{mixed} (padding rows write only the scratch page and "
            "state slot, never a real row)")


def mixed_graphs(config: EngineConfig, model, query_lens: tuple[int, ...]) -> bool:
    """``graph.mixed`` resolved: graphs of one-token decode rows plus a prompt piece, where
    every attention impl can replay prompt rows (``graph_prompt_rows``: nothing planned on the
    host from the step's positions or pages) and the strategy decodes one token a step (AR)."""
    want = config.graph.mixed
    if want is True and not config.graph.enabled:
        raise ConfigError("graph.mixed", "mixed steps replay CUDA graphs; set graph.enabled: true, or graph.mixed: "
                          "auto or false")
    if not config.graph.enabled or want is False:
        return False
    refusing = sorted({type(m.attn).__name__ for m in model.modules()
                       if getattr(m, "attn", None) is not None and not getattr(m.attn, "graph_prompt_rows", False)})
    if want is True and refusing:
        raise ConfigError("graph.mixed", f"{', '.join(refusing)} plans prompt rows on the host every step and "
                          "cannot replay them from a CUDA graph (the invariant backend's attention can); "
                          "use graph.mixed: auto or false")
    if want is True and query_lens != (1,):
        raise ConfigError("graph.mixed", f"strategy {config.strategy.name!r} decodes in steps of {max(query_lens)} "
                          "tokens; mixed graphs hold one-token decode rows beside a prompt chunk; use graph.mixed: "
                          "auto or false")
    return not refusing and query_lens == (1,)


def mixed_fields(config: EngineConfig, model, query_lens: tuple[int, ...], chunk: int) -> dict:
    """The graph runner's mixed-step fields: a one-token decode strategy's steps of decode rows
    plus a prompt piece (``mixed_graphs``); for another strategy (MTP) with ``graph.mixed``
    auto, a prompt piece alone (bucket 0: no decode rows, so no decode length to match), where
    every attention impl can replay prompt rows."""
    if mixed_graphs(config, model, query_lens):
        return {"prompt_chunk": chunk}
    lone = (config.graph.enabled and config.graph.mixed == "auto" and query_lens != (1,)
            and all(getattr(m.attn, "graph_prompt_rows", False) for m in model.modules()
                    if getattr(m, "attn", None) is not None))
    return {"prompt_chunk": chunk, "mixed_decode_rows": False} if lone else {"prompt_chunk": 0}
