"""Engine configuration: attrs classes that mirror the YAML, with validation that names key paths.

Each field carries a ``parse`` function in its metadata; :func:`_parse_section` walks a dict,
rejects unknown keys and reports the first problem as ``ConfigError("a.b.c", "...")``.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attr
import attrs

from bi_core.config_file import read_yaml as _read_yaml
from bi_core.errors import ConfigError

Parser = Callable[[Any, str], Any]

DTYPES = ("float32", "bfloat16")
OP_NAMES = ("attention", "linear", "norm", "topk", "moe", "gdn", "sampling", "all_reduce", "all_gather", "layer_norm",
            "vision_attention", "lora")
# names that were ops once: what took their place (a config or a plugin naming one gets this, not "unknown op")
RETIRED_OPS = {"graph_runner": "no longer an op: the runtime launches steps itself (CUDA graphs are graph.enabled, "
                               "their capture graph.capture)"}
INVARIANT_ENV = "BI_ENABLE_BATCH_INVARIANT"
# seeds are keys of 64 bits (bi_core.ops.sampling.mix_seed works modulo 2**64, torch's generators
# take at most 2**64 - 1): a larger one would alias a smaller one
MAX_SEED = (1 << 64) - 1


# ---------------------------------------------------------------------------------- parsers


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _int(minimum: int | None = None, maximum: int | None = None) -> Parser:
    def parse(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(path, f"expected an int, got {_type_name(value)} {value!r}")
        if minimum is not None and value < minimum:
            what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
            raise ConfigError(path, f"expected {what}, got {value}")
        if maximum is not None and value > maximum:
            raise ConfigError(path, f"expected an int <= {maximum}, got {value}")
        return value

    return parse


_YAML_STR_EXPONENT = re.compile(r"[-+]?[0-9]+[eE][-+]?[0-9]+")


def _float(minimum: float | None = None, maximum: float | None = None, *, above_minimum: bool = False) -> Parser:
    """A finite number in [minimum, maximum] (``above_minimum``: in (minimum, maximum]). NaN compares
    false with every bound, so it is refused by name, as is inf: no float key has a meaning for it."""
    low = "(" if above_minimum else "["
    bounds = f" in {low}{'-inf' if minimum is None else minimum}, {'inf' if maximum is None else maximum}]" \
        if minimum is not None or maximum is not None else ""

    def parse(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            hint = ""
            if isinstance(value, str) and _YAML_STR_EXPONENT.fullmatch(value):  # YAML 1.1 floats need a dot
                hint = f" (YAML reads {value} as a string; write it with a dot, e.g. 1.0e-3)"
            raise ConfigError(path, f"expected a number, got {_type_name(value)} {value!r}{hint}")
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(path, f"expected a finite number{bounds}, got {value}")
        if minimum is not None and (value <= minimum if above_minimum else value < minimum) or \
                maximum is not None and value > maximum:
            raise ConfigError(path, f"expected a number{bounds}, got {value}")
        try:
            return float(value)
        except OverflowError:  # an int beyond any float
            raise ConfigError(path, f"expected a finite number{bounds}, got {value}") from None

    return parse


def _seed(value: Any, path: str) -> int:
    seed = _int(0)(value, path)
    if seed > MAX_SEED:
        raise ConfigError(path, f"expected a seed in [0, 2**64 - 1] (random draws are keyed by 64 bits), got {seed}")
    return seed


def _bool(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(path, f"expected true or false, got {_type_name(value)} {value!r}")
    return value


def _str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(path, f"expected a non-empty string, got {_type_name(value)} {value!r}")
    return value


def _choice(*choices: str) -> Parser:
    def parse(value: Any, path: str) -> str:
        if value not in choices:
            raise ConfigError(path, f"expected one of {', '.join(choices)}; got {value!r}")
        return value

    return parse


def _optional(inner: Parser) -> Parser:
    return lambda value, path: None if value is None else inner(value, path)


def _auto_or(inner: Parser) -> Parser:
    return lambda value, path: "auto" if value == "auto" else inner(value, path)


def _str_list(value: Any, path: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ConfigError(path, f"expected a non-empty list of names, got {_type_name(value)} {value!r}")
    return tuple(_str(v, f"{path}[{i}]") for i, v in enumerate(value))


def _op_preferences(value: Any, path: str) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping of op name to backend list, got {_type_name(value)}")
    out = {}
    for op, names in value.items():
        if op in RETIRED_OPS:
            raise ConfigError(f"{path}.{op}", f"{RETIRED_OPS[op]}; remove this key")
        if op not in OP_NAMES:
            raise ConfigError(f"{path}.{op}", f"unknown op; expected one of {', '.join(OP_NAMES)}")
        out[op] = _str_list(names, f"{path}.{op}")
    return out


def _prompts(value: Any, path: str) -> tuple[str | tuple[int, ...], ...]:
    if not isinstance(value, list):
        raise ConfigError(path, f"expected a list of prompts, got {_type_name(value)}")
    out: list[str | tuple[int, ...]] = []
    for i, p in enumerate(value):
        if isinstance(p, str) and p:
            out.append(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in p):
            out.append(tuple(p))
        else:
            raise ConfigError(f"{path}[{i}]", "expected a non-empty string or a non-empty list of token ids")
    return tuple(out)


_CLASS_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*[:.][A-Za-z_]\w*")


def _class_path(value: Any, path: str) -> str:
    """``module.path:ClassName`` or ``module.path.ClassName``; imported when the engine is built."""
    value = _str(value, path)
    if not _CLASS_PATH.fullmatch(value):
        raise ConfigError(path, f"expected 'module.path:ClassName' or 'module.path.ClassName', got {value!r}")
    return value


def _section(cls: type) -> Parser:
    return lambda value, path: _parse_section(cls, value, path)


def _field(parse: Parser, default: Any = attrs.NOTHING, factory: Any = None, doc: str = "") -> Any:
    if factory is not None:
        return attrs.field(factory=factory, metadata={"parse": parse, "doc": doc})
    return attrs.field(default=default, metadata={"parse": parse, "doc": doc})


def _parse_section(cls: type, data: Any, path: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path or "<root>", f"expected a mapping, got {_type_name(data)} {data!r}")
    fields = {f.name: f for f in attrs.fields(cls)}
    for key in data:
        if key not in fields:
            where = f"{path}.{key}" if path else str(key)
            raise ConfigError(where, f"unknown key; allowed keys here: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = f.metadata["parse"](data[name], f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{path}.{e.path}" if path and e.path else (e.path or path), e.reason) from None


# ---------------------------------------------------------------------------------- sections


@attrs.frozen(kw_only=True)
class RandomModelConfig:
    """A model built from a preset with random weights: no checkpoint, no download."""

    preset: str = _field(_str, "tiny-dense", doc="tiny-dense | tiny-moe | a real-shape preset name")
    seed: int = _field(_seed, 0)
    num_hidden_layers: int | None = _field(_optional(_int(1)), None, doc="override the preset's depth")

    def __attrs_post_init__(self) -> None:
        from bi_core.models.presets import PRESETS

        if self.preset not in PRESETS:
            raise ConfigError("preset", f"unknown preset {self.preset!r}; expected one of {', '.join(PRESETS)}")


@attrs.frozen(kw_only=True)
class ModelConfig:
    path: str | None = _field(_optional(_str), None, doc="Hugging Face checkpoint directory")
    random: RandomModelConfig | None = _field(_optional(_section(RandomModelConfig)), None)
    dtype: str = _field(_choice(*DTYPES), "bfloat16")
    device: str = _field(_str, "auto", doc="auto | cpu | cuda | cuda:N")
    tokenizer: str | None = _field(_optional(_str), None, doc="tokenizer directory (default: model.path)")
    max_model_len: int | None = _field(_optional(_int(1)), None, doc="default: max_position_embeddings")
    enable_return_routed_experts: bool = _field(_bool, False, doc="record every MoE layer's top-k expert ids so "
                                                "requests can ask for them (SamplingParams.return_routed_experts)")
    quantization: str | None = _field(_optional(_choice("none", "fp8")), None,
                                      doc="weight format; unset: as the checkpoint is stored (an FP8 checkpoint's "
                                          "config.json quantization_config is read); fp8: block-wise FP8 (W8A8, "
                                          "128x128 weight blocks, the official Qwen3.5-FP8 scheme), quantizing a "
                                          "bf16/fp32 checkpoint or a random preset on load; none: unquantized (an "
                                          "FP8 checkpoint is refused)")

    def __attrs_post_init__(self) -> None:
        if (self.path is None) == (self.random is None):
            raise ConfigError("", "set exactly one of model.path (a checkpoint) or model.random (a preset)")
        if self.device != "auto" and not (self.device in ("cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("device", f"expected auto, cpu, cuda or cuda:N; got {self.device!r}")
        if self.path is not None:
            p = Path(self.path)
            if not p.is_dir():
                raise ConfigError("path", f"checkpoint directory {self.path} does not exist")
            if not (p / "config.json").is_file():
                raise ConfigError("path", f"no config.json in {self.path}")
            if not any(p.glob("*.safetensors")):
                raise ConfigError("path", f"no *.safetensors files in {self.path}")
        if self.tokenizer is not None:
            from bi_core.models.tokenizer import tokenizer_dir_problem

            if (problem := tokenizer_dir_problem(self.tokenizer)) is not None:
                raise ConfigError("tokenizer", problem)


@attrs.frozen(kw_only=True)
class PolicyConfig:
    batch_invariant: bool = _field(_bool, False)
    ops: dict[str, tuple[str, ...]] = _field(_op_preferences, factory=dict, doc="per-op backend order")
    expert_parallel_size: int = _field(_int(1), 1)
    eplb: bool = _field(_bool, False, doc="expert-parallel load balancing")


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    max_num_seqs: int = _field(_int(1), 64)
    max_num_batched_tokens: int = _field(_int(1), 8192)
    prefill_chunk_size: int | None = _field(_optional(_int(1)), None, doc="default: half of what the decode "
                                            "rows of max_num_seqs sequences leave of max_num_batched_tokens, in "
                                            "whole KV pages (bi_core.runtime.scheduler.resolve_chunk_size)")

    def __attrs_post_init__(self) -> None:
        if self.prefill_chunk_size is not None and self.prefill_chunk_size > self.max_num_batched_tokens:
            raise ConfigError("prefill_chunk_size", "must not exceed scheduler.max_num_batched_tokens")


@attrs.frozen(kw_only=True)
class CacheConfig:
    block_size: int = _field(_int(1, 1024), 16)
    num_blocks: int | str = _field(_auto_or(_int(1)), "auto")
    kv_cache_dtype: str = _field(_choice("auto", "fp8", "fp8_e4m3"), "auto",
                                 doc="auto = model dtype; fp8 (= fp8_e4m3): keys and values stored as "
                                     "float8_e4m3fn at a fixed scale of 1 (invariant too)")
    ssm_state_dtype: str = _field(_choice("float32", "bfloat16"), "float32", doc="GDN recurrent state dtype")
    gpu_memory_utilization: float = _field(_float(0.05, 0.99), 0.9)
    prefix_caching: bool | str = _field(_auto_or(_bool), "auto",
                                        doc="reuse cached prompt chunks (exact); auto = on, off with strategy mtp")
    prefix_snapshots: int = _field(_int(1, 4096), 8, doc="GDN state snapshots the prefix cache keeps "
                                   "(each one sequence's GDN state, e.g. 63 MB for Qwen3.5-35B-A3B in float32)")


@attrs.frozen(kw_only=True)
class GraphConfig:
    enabled: bool = _field(_bool, False, doc="run uniform steps (decode, MTP verify) through CUDA graphs, one per "
                           "batch bucket (padding rows write only a scratch page and state slot, never a real row)")
    capture: bool | str = _field(_auto_or(_bool), "auto", doc="with graph.enabled: capture the graphs (a CUDA "
                                 "device), or false: rerun every graph step eagerly on the graphs' static buffers "
                                 "(the same buckets, padding and static contexts, on any device: a check of the "
                                 "graph path); auto = capture on a CUDA device, rerun elsewhere")
    max_batch_size: int | None = _field(_optional(_int(1)), None, doc="default: scheduler.max_num_seqs")
    warmup: bool = _field(_bool, True, doc="at start (CUDA, graphs enabled): capture every graph, largest batch "
                          "first, and run a few dummy prompts so no capture or kernel compile stalls a running batch")
    mixed: bool | str = _field(_auto_or(_bool), "auto", doc="also capture steps of decode rows plus one prompt piece "
                               "(up to the scheduler's chunk size; a shorter last piece is padded), so a long prompt's "
                               "chunks among running streams replay a graph instead of eager launches; "
                               "auto = on where the attention kernel can replay prompt rows (the invariant backend's), "
                               "off with FlashInfer's host planning; with MTP, auto captures a prompt piece alone "
                               "only (its decode rows are several tokens)")
    overlap: bool = _field(_bool, True, doc="launch the next decode step before this one's tokens reach the host "
                           "(AR steps replayed from a graph, sampled on the device), and MTP's head behind its verify "
                           "before the commit (the invariant backend): the host plans and books steps while the "
                           "device runs; outputs are the same")


@attrs.frozen(kw_only=True)
class ParallelConfig:
    tensor_parallel_size: int = _field(_int(1, 64), 1, doc="GPUs one model is split over (one process each, "
                                       "started by the engine)")
    data_parallel_size: int = _field(_int(1, 1024), 1, doc="bi-engine serve only: replicas of the whole engine "
                                     "(each with its own tensor-parallel group), placed and supervised by Ray "
                                     "behind sglang-router (the scale extra); 1 = one server, no Ray")
    worker_extension_cls: str | None = _field(_optional(_class_path), None, doc="vLLM's worker_extension_cls: "
                                              "'module.path:ClassName' whose methods are mixed into every rank's "
                                              "worker, for LLMEngine.collective_rpc (bi_core.rl.collective_rpc)")


@attrs.frozen(kw_only=True)
class StrategyConfig:
    name: str = _field(_str, "ar", doc="ar | mtp | a plugin strategy")
    num_speculative_tokens: int | None = _field(_optional(_int(1, 4)), None)
    draft_vocab_size: int | None = _field(_optional(_int(1)), None,
                                          doc="MTP drafts choose among this many token ids (a pruned lm_head); "
                                              "None = the whole vocabulary")
    draft_vocab: str | None = _field(_optional(_str), None,
                                     doc="file of token ids, most frequent first (whitespace-separated or a JSON "
                                         "list); default: the lowest ids (a byte-level BPE's earliest merges)")


@attrs.frozen(kw_only=True)
class SamplingConfig:
    """Defaults for the CLI's requests (the Python API takes SamplingParams)."""

    max_new_tokens: int = _field(_int(1), 32)
    temperature: float = _field(_float(0.0, 100.0), 0.0)
    top_k: int = _field(_int(0), 0, doc="0 = off")
    top_p: float = _field(_float(0.0, 1.0, above_minimum=True), 1.0,
                          doc="nucleus sampling: the smallest set of tokens whose probability reaches top_p; 1.0 = off")
    seed: int | None = _field(_optional(_seed), None)
    logprobs: int | None = _field(_optional(_int(0, 20)), None)
    ignore_eos: bool = _field(_bool, False)


@attrs.frozen(kw_only=True)
class ServeConfig:
    """``bi-engine serve``: the OpenAI-compatible HTTP server (CLI flags override host/port/api_key)."""

    host: str = _field(_str, "127.0.0.1")
    port: int = _field(_int(0, 65535), 8000)
    model_name: str | None = _field(_optional(_str), None, doc="the model id clients send (default: checkpoint "
                                                              "directory or preset name)")
    api_key: str | None = _field(_optional(_str), None, doc="require 'Authorization: Bearer <key>' on every route "
                                 "but /health and /metrics (and on the control routes, unless admin_api_key is set)")
    admin_api_key: str | None = _field(_optional(_str), None, doc="SGLang's admin key: the control routes (weight "
                                       "updates, sleep, pause, aborts, ...) need it, and api_key no longer opens them")
    allow_unauthenticated_control: bool = _field(_bool, False, doc="let the control routes answer without a key on "
                                                 "a host beyond loopback (default: they answer 403 there until a key "
                                                 "is set; docs/security.md)")
    weights_root: str | None = _field(_optional(_str), None, doc="the directory /update_weights_from_disk may read "
                                      "checkpoints under (default: model.path's parent; none for a random model)")
    weight_sync_timeout_s: float = _field(_float(0.1, 86400.0), 300.0, doc="how long joining a trainer's "
                                          "weight-update group (and each of its collectives) may wait for the "
                                          "trainer; generation goes on meanwhile")
    max_waiting_requests: int = _field(_int(1), 4096, doc="requests queued beyond this are refused with 503")
    shutdown_timeout_s: float = _field(_float(0.0, 3600.0), 30.0, doc="on SIGTERM/SIGINT, in-flight requests "
                                                                     "finish within this, then are aborted")
    dev_mode: bool = _field(_bool, False, doc="development routes (POST /collective_rpc: runs a worker method "
                            "the client names); off: they do not exist (404). VLLM_SERVER_DEV_MODE=1 turns it on too")


def _adapters(value: Any, path: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ConfigError(path, f"expected a mapping of adapter name to its PEFT directory, got {_type_name(value)}")
    for name, where in value.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(path, f"adapter names must be non-empty strings, got {name!r}")
        _str(where, f"{path}.{name}")
    return dict(value)


@attrs.frozen(kw_only=True)
class LoraConfig:
    """LoRA adapters served alongside the base model (docs/lora.md): fixed slots on the device."""

    max_loras: int = _field(_int(0, 256), 0, doc="adapter slots on the device (vLLM's max_loras); 0: no LoRA")
    max_rank: int = _field(_int(1, 512), 64, doc="the largest adapter rank a slot holds (vLLM's max_lora_rank)")
    adapters: dict = _field(_adapters, factory=dict, doc="name -> PEFT adapter directory, loaded at start (a "
                            "request names one by model or lora_path)")
    experts: bool = _field(_bool, False, doc="MoE models: adapters on the experts and the shared expert too "
                           "(max_loras x experts x max_rank stacks per layer; the experts' GEMMs then run unfused)")

    def __attrs_post_init__(self) -> None:
        if len(self.adapters) > self.max_loras:
            raise ConfigError("adapters", f"{len(self.adapters)} adapters but lora.max_loras={self.max_loras} slots; "
                              f"raise lora.max_loras to at least {len(self.adapters)}")


@attrs.frozen(kw_only=True)
class VisionConfig:
    """Images and videos in (a checkpoint with a vision tower; docs/vision.md)."""

    enabled: bool | str = _field(_auto_or(_bool), "auto", doc="load the checkpoint's vision tower (model.visual.*) "
                                 "and take images; auto: when config.json has a vision_config")
    max_images_per_request: int = _field(_int(0), 16, doc="images plus videos one request may carry")
    max_pixels_per_request: int = _field(_int(1), 16 * 1024 * 1024, doc="pixels of all its images and video "
                                         "frames after the processor's resize")
    max_vision_tokens_per_request: int = _field(_int(1), 16384, doc="placeholder tokens of all its images and "
                                                "videos (after the 2x2 merge)")
    max_num_encoder_input_tokens: int = _field(_int(1), 2048, doc="vision tokens (after the merge) the tower "
                                               "encodes between two steps, image by image, while other requests "
                                               "run (vLLM's name); an image larger than that is encoded alone")
    media_root: str | None = _field(_optional(_str), None, doc="the directory local image files (file: URLs and "
                                    "paths in requests) may be read from; none: local files are refused")
    random_depth: int | None = _field(_optional(_int(1)), None, doc="a random model's tower (vision.enabled: true "
                                      "with model.random): its blocks; default the published 27")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """The whole engine, as in the YAML file."""

    model: ModelConfig = _field(_section(ModelConfig))
    policy: PolicyConfig = _field(_section(PolicyConfig), factory=PolicyConfig)
    backend: str = _field(_str, "auto", doc="auto | reference | cuda_default | cuda_hopper_invariant | plugin; "
                          "auto: the mode's backend (policy.batch_invariant sets the mode): cuda_hopper_invariant "
                          "when invariant, else cuda_default on a CUDA device and reference on any other; an "
                          "explicit one serves every op not in policy.ops, and in invariant mode must support it")
    scheduler: SchedulerConfig = _field(_section(SchedulerConfig), factory=SchedulerConfig)
    cache: CacheConfig = _field(_section(CacheConfig), factory=CacheConfig)
    graph: GraphConfig = _field(_section(GraphConfig), factory=GraphConfig)
    parallel: ParallelConfig = _field(_section(ParallelConfig), factory=ParallelConfig)
    strategy: StrategyConfig = _field(_section(StrategyConfig), factory=StrategyConfig)
    sampling: SamplingConfig = _field(_section(SamplingConfig), factory=SamplingConfig)
    serve: ServeConfig = _field(_section(ServeConfig), factory=ServeConfig)
    lora: LoraConfig = _field(_section(LoraConfig), factory=LoraConfig)
    vision: VisionConfig = _field(_section(VisionConfig), factory=VisionConfig)
    prompts: tuple = _field(_prompts, factory=tuple)
    seed: int = _field(_seed, 0, doc="seeds requests that have no seed of their own")

    @classmethod
    def from_dict(cls, data: dict, *, apply_env: bool = True) -> EngineConfig:
        if not isinstance(data, dict) or "model" not in data:
            raise ConfigError("model", "missing required section (model.path or model.random)")
        config = _parse_section(cls, data, "")
        return config.with_env() if apply_env else config

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, *, apply_env: bool = True) -> EngineConfig:
        data = _read_yaml(Path(path))
        return cls.from_dict(data if data is not None else {}, apply_env=apply_env)

    def with_env(self) -> EngineConfig:
        """``BI_ENABLE_BATCH_INVARIANT=1`` turns invariance on (``0`` turns it off)."""
        value = os.environ.get(INVARIANT_ENV)
        if value is None or value == "":
            return self
        if value not in ("0", "1"):
            raise ConfigError(INVARIANT_ENV, f"expected 0 or 1, got {value!r}")
        return self.replace(policy={"batch_invariant": value == "1"})

    def replace(self, **sections: Any) -> EngineConfig:
        """Copy with some sections changed; dict values update the section field by field."""
        changes = {}
        for name, value in sections.items():
            current = getattr(self, name)
            if isinstance(value, dict) and attrs.has(type(current)):
                changes[name] = attrs.evolve(current, **value)
            else:
                changes[name] = value
        return attrs.evolve(self, **changes)

    def to_dict(self) -> dict:
        """Plain dicts and lists (``from_dict`` reads it back)."""
        return attr.asdict(self, recurse=True, retain_collection_types=False)  # attrs.asdict keeps tuples
