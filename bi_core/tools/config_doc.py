"""docs/configuration.md, generated from the config classes (``bi_core/config.py``): every key by its
full dotted path, with its type, default, allowed values (read from the key's parser) and meaning
(the field's ``doc=``). ``tests/unit/test_config_doc.py`` fails while the file is stale.

    python -m bi_core.tools.config_doc > docs/configuration.md
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from bi_core import config as cfg

REGENERATE = "python -m bi_core.tools.config_doc > docs/configuration.md"

# Meanings of the keys declared without ``doc=`` in bi_core/config.py (a field's own doc wins, and a
# test fails while an entry here repeats one). Move an entry into its field when config.py is next
# edited; section entries (no dot past the section name) describe the section.
EXTRA_DOCS = {
    "model": "the model: a checkpoint (model.path) or a random preset (model.random), exactly one",
    "model.random": "a preset's shape with random weights, no checkpoint or download (set instead of model.path)",
    "model.random.seed": "seed of the random weights (the same seed and preset give the same model everywhere)",
    "model.dtype": "dtype of the weights and activations (an FP8 model keeps its non-FP8 parts in this dtype)",
    "policy": "what the mode demands of every op, and the order backends are asked in",
    "policy.batch_invariant": "batch-invariant mode: a request's tokens and logprobs do not depend on the rest of "
                              "the batch (needs an SM90 GPU; --batch-invariant and BI_ENABLE_BATCH_INVARIANT override it)",
    "policy.expert_parallel_size": "only 1: expert parallelism is not implemented (batch-invariant mode refuses it "
                                   "for good: a token's experts would move between GPUs with the batch)",
    "scheduler": "continuous batching: how many sequences and tokens a step holds, and the prompt chunk size",
    "scheduler.max_num_seqs": "sequences running at once (decode rows of a step; also the largest n of a request)",
    "scheduler.max_num_batched_tokens": "tokens one step may process (decode rows plus prompt chunks)",
    "cache": "the paged KV cache, GDN state slots and the prefix cache",
    "cache.block_size": "tokens per KV page",
    "cache.num_blocks": "KV pages; auto = as many as cache.gpu_memory_utilization leaves after the weights",
    "cache.gpu_memory_utilization": "fraction of the GPU's memory the engine may use (weights, states, KV pages)",
    "graph": "CUDA graphs (decode, MTP verify and head steps, mixed steps)",
    "parallel": "tensor parallelism inside one host, replicas behind a router (docs/scale-out.md)",
    "strategy": "how a decoding step is planned: ar (autoregressive) or mtp (speculative, bitwise AR's output)",
    "strategy.num_speculative_tokens": "mtp: drafts verified per step (unset: 1)",
    "sampling.max_new_tokens": "tokens generated per request",
    "sampling.temperature": "0 = greedy",
    "sampling.seed": "seed of each CLI request's random draws (unset: derived from the top-level seed and the "
                     "request id)",
    "sampling.logprobs": "top-N logprobs reported per generated token (and the sampled token's own)",
    "sampling.ignore_eos": "keep generating past the end-of-sequence token",
    "serve.host": "address the server binds (--host overrides it)",
    "serve.port": "port the server binds (--port overrides it; 0 = any free port)",
    "prompts": "prompts the CLI runs (bi-engine run): strings, or lists of token ids",
}



def _presets() -> str:
    from bi_core.models.presets import PRESETS

    return ", ".join(PRESETS)


def _registered(kind: str) -> Callable[[], str]:
    def names() -> str:
        from bi_core.plugins import load_registry

        registry = load_registry(load_entry_points=False)  # built-ins only: the page must not depend on the machine
        first = ["auto"] if kind == "backends" else []
        return ", ".join([*first, *sorted(getattr(registry, kind))]) + ", or a plugin's"
    return names


# Keys whose values are checked after parsing (a section's own checks, the registry): their allowed values.
ALLOWED = {
    "model.device": lambda: "auto, cpu, cuda, cuda:N",
    "model.random.preset": _presets,
    "backend": _registered("backends"),
    "strategy.name": _registered("strategies"),
}

# Read by bi-engine (not config keys), so that this page lists every setting a user can make.
ENVIRONMENT = (
    ("BI_ENABLE_BATCH_INVARIANT", "1 or 0: overrides policy.batch_invariant (anything else is an error)"),
    ("BI_PLUGINS", "comma-separated entry-point names: load only these plugins"),
    ("BI_DISABLE_PLUGINS", "comma-separated entry-point names (or all): skip these plugins"),
    ("BI_COMPILE_AHEAD", "0: do not compile Triton kernels ahead from a recorded manifest at start"),
    ("BI_PDL", "0: launch kernels without programmatic dependent launch (for A/B timings)"),
    ("BI_BENCH_TOP_KERNELS", "N: bi-engine bench also prints one eager step's top N kernels"),
    ("BI_BENCH_PROFILE_HOST", "N: bi-engine bench also prints a cProfile of the timed steps' host work"),
    ("VLLM_SERVER_DEV_MODE", "1: as serve.dev_mode: true"),
    ("OMP_NUM_THREADS", "torch CPU threads (the engine otherwise picks them: docs/serving.md)"),
)


@attrs.frozen
class Key:
    """One config key as the page lists it."""

    path: str
    type: str
    default: str
    allowed: str
    meaning: str


def _yaml(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _range(minimum: Any, maximum: Any) -> str:
    if minimum is None and maximum is None:
        return "any"
    if maximum is None:
        return f">= {minimum}"
    if minimum is None:
        return f"<= {maximum}"
    return f"{minimum} .. {maximum}"


def describe(parse: Callable, annotation: str = "") -> tuple[str, str]:
    """(type, allowed values) of a key, read from its parser in bi_core/config.py."""
    name = parse.__qualname__.split(".<locals>")[0]
    free = inspect.getclosurevars(parse).nonlocals if parse.__closure__ else {}
    if name == "_int":
        return "int", _range(free["minimum"], free["maximum"])
    if name == "_float":
        allowed = _range(free["minimum"], free["maximum"])
        return "number", allowed.replace(" .. ", " (excluded) .. ", 1) if free.get("above_minimum") else allowed
    if name == "_choice":
        return "string", ", ".join(free["choices"])
    if name == "_optional":
        kind, allowed = describe(free["inner"], annotation.replace(" | None", ""))
        return f"{kind} or null", f"{allowed}, or null" if allowed else "null"
    if name == "_auto_or":
        kind, allowed = describe(free["inner"], annotation)
        return f"{kind} or auto", f"auto, or {allowed}" if allowed else "auto"
    known = {
        "_bool": ("bool", "true, false"),
        "_str": ("string", "non-empty"),
        "_str_list": ("list", "names (one name alone is a list of one)"),
        "_class_path": ("string", "'module.path:ClassName' or 'module.path.ClassName'"),
        "_op_preferences": ("mapping", f"op ({', '.join(cfg.OP_NAMES)}) -> backend names, most preferred first"),
        "_prompts": ("list", "non-empty strings, or non-empty lists of token ids"),
        "_seed": ("int", "0 .. 2**64 - 1"),
    }
    if name in known:
        return known[name]
    # a parser this page does not know yet: the annotation, and the parser's own docstring
    doc = (inspect.getdoc(parse) or "").split("\n")[0]
    return annotation or "?", doc


def _section_of(f: attrs.Attribute) -> type | None:
    parse = f.metadata["parse"]
    if parse.__qualname__.startswith("_section.") or (parse.__qualname__.startswith("_optional.")
                                                      and inspect.getclosurevars(parse).nonlocals["inner"]
                                                      .__qualname__.startswith("_section.")):
        inner = parse if parse.__qualname__.startswith("_section.") else inspect.getclosurevars(parse).nonlocals["inner"]
        return inspect.getclosurevars(inner).nonlocals["cls"]
    return None


def _default(f: attrs.Attribute) -> str:
    if f.default is attrs.NOTHING:
        return "required"
    if isinstance(f.default, attrs.Factory):  # type: ignore[arg-type]
        return _yaml(f.default.factory())
    return _yaml(f.default)


def keys(cls: type = cfg.EngineConfig, prefix: str = "") -> Iterator[Key | tuple[str, str]]:
    """Every key under ``cls`` in declaration order; a section yields (path, its description) first."""
    for f in attrs.fields(cls):
        path = f"{prefix}{f.name}"
        section = _section_of(f)
        if section is not None:
            yield path, _meaning(path, f.metadata["doc"] or (inspect.getdoc(section) or "").split("\n")[0])
            yield from keys(section, path + ".")
            continue
        kind, allowed = describe(f.metadata["parse"], str(f.type))
        allowed = ALLOWED[path]() if path in ALLOWED else allowed
        yield Key(path, kind, _default(f), allowed, _meaning(path, f.metadata["doc"]))


def _meaning(path: str, doc: str) -> str:
    return doc or EXTRA_DOCS.get(path, "")


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _groups() -> dict[str, tuple[str, list[Key]]]:
    """Section path ("" for the top level) -> (its description, its own keys), in declaration order."""
    groups: dict[str, tuple[str, list[Key]]] = {"": ("Keys at the top level of the file.", [])}
    for item in keys():
        if isinstance(item, tuple):
            groups[item[0]] = (item[1], [])
        else:
            groups[item.path.rpartition(".")[0]][1].append(item)
    return groups


def render() -> str:
    """The whole page."""
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from bi_core/config.py by `{REGENERATE}`; do not edit by hand. -->",
        "",
        "An engine is configured by one YAML file (`bi-engine --config FILE`, `EngineConfig.from_yaml`) or a",
        "dict (`EngineConfig.from_dict`). Every key is optional except the model (`model.path` or",
        "`model.random`). An unknown key, a value of the wrong type or out of range is one error naming the",
        "key's path and what is allowed. Starting points: `configs/*.yaml`.",
        "",
        "```yaml",
        "model: {random: {preset: tiny-moe, seed: 0}, dtype: float32, device: cpu}",
        "scheduler: {max_num_seqs: 8}",
        "```",
        "",
    ]
    for path, (meaning, own) in _groups().items():
        if not own:
            continue
        out += [f"## `{path}`" if path else "## Top level", ""] + ([meaning, ""] if meaning else [])
        out += ["| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        out += [f"| `{k.path}` | {k.type} | `{_cell(k.default)}` | {_cell(k.allowed)} | {_cell(k.meaning)} |"
                for k in own]
        out.append("")
    out += ["## Environment variables", "", "Read by bi-engine besides the YAML file.", "",
            "| variable | effect |", "|---|---|"]
    out += [f"| `{name}` | {_cell(effect)} |" for name, effect in ENVIRONMENT]
    out += ["", "Command-line flags that override keys: `--batch-invariant/--no-batch-invariant`",
            "(`policy.batch_invariant`), `bi-engine serve --host/--port/--api-key/--dev-mode/--data-parallel-size`",
            "(`serve.*`, `parallel.data_parallel_size`), `--num-layers` (`model.random.num_hidden_layers`).", ""]
    return "\n".join(out)


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
