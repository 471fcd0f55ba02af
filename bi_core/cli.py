"""``bi-engine``: run | explain | plugins. Errors print as one line (exit 2), never a traceback."""

from __future__ import annotations

import argparse
import json
import sys

import attrs

from bi_core.config import EngineConfig, SamplingConfig
from bi_core.errors import BiEngineError, ConfigError
from bi_core.tools.flags import config_value, positive_ints, token_ids

SUBCOMMANDS = ("run", "explain", "plugins", "verify", "bench", "serve", "draft-vocab")
INVARIANT_HELP = (
    "override policy.batch_invariant. Invariant mode makes every request's tokens and logprobs bitwise "
    "independent of the batch; it runs only on SM90 (Hopper) GPUs with the cuda_hopper_invariant backend, "
    "and refuses expert parallelism > 1, EPLB and the reference backend (its PyTorch "
    "kernels pick reduction orders by shape)."
)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="engine YAML file (see configs/)")
    p.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None, help=INVARIANT_HELP)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bi-engine", description="Batch-invariant Qwen3.5 inference engine.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="generate for the configured prompts (the default command)")
    _add_config_args(run)
    run.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    run.add_argument("--prompt-ids", action="append", default=[], help="a prompt as comma-separated token ids")
    run.add_argument("--max-new-tokens", type=config_value(SamplingConfig, "max_new_tokens", int),
                     help="override sampling.max_new_tokens")
    run.add_argument("--temperature", type=config_value(SamplingConfig, "temperature", float),
                     help="override sampling.temperature")
    run.add_argument("--seed", type=config_value(SamplingConfig, "seed", int), help="override sampling.seed")
    run.add_argument("--logprobs", type=config_value(SamplingConfig, "logprobs", int),
                     help="top-N logprobs per step")
    run.add_argument("--json", action="store_true", help="machine-readable output")
    explain = sub.add_parser("explain", help="which backend serves each op, and why others were refused")
    _add_config_args(explain)
    sub.add_parser("plugins", help="list loaded plugins, backends and strategies")
    verify = sub.add_parser("verify", help="batch-invariance audit: each prompt alone vs in many batches")
    _add_config_args(verify)
    verify.add_argument("--num-prompts", type=int, default=32)
    verify.add_argument("--batch-sizes", help="comma-separated, each at most scheduler.max_num_seqs (default: those "
                        "of 1,2,3,7,8,15,16,17,32,64,128,256 up to scheduler.max_num_seqs)")
    verify.add_argument("--max-new-tokens", type=int, default=32)
    verify.add_argument("--modes", default="greedy,sampled", help="greedy and/or sampled (seeded temperature 0.8)")
    verify.add_argument("--num-layers", type=int, help="cut a random preset to this many layers (faster audits)")
    verify.add_argument("--negative-control", action="store_true",
                        help="run the same audit on the default backend; it must find mismatches")
    verify.add_argument("--seed", type=int, default=0)
    verify.add_argument("--strategies", default="ar",
                        help="ar, or ar,mtp: also check that MTP speculative decoding emits the AR outputs bitwise")
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (needs the serve extra)")
    _add_config_args(serve)
    serve.add_argument("--host", help="override serve.host (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="override serve.port (default 8000)")
    serve.add_argument("--api-key", help="override serve.api_key: require 'Authorization: Bearer <key>'")
    serve.add_argument("--admin-api-key", help="override serve.admin_api_key: the key of the control routes "
                                               "(docs/security.md)")
    serve.add_argument("--dev-mode", action="store_true", help="override serve.dev_mode: development routes "
                       "(POST /collective_rpc), as vLLM's VLLM_SERVER_DEV_MODE=1")
    serve.add_argument("--data-parallel-size", type=int, help="override parallel.data_parallel_size: N > 1 replicas "
                       "placed with Ray behind sglang-router on --port, control routes on --control-port (needs the "
                       "scale extra)")
    serve.add_argument("--ray-address", help="replicas: the Ray cluster to join (auto, ray://HOST:10001, ...); "
                       "default: RAY_ADDRESS, else a Ray instance on this machine")
    serve.add_argument("--router-policy", help="replicas: sglang-router's policy, cache_aware (default), "
                       "round_robin, power_of_two or random")
    serve.add_argument("--control-port", type=int, help="replicas: port of the control routes fanned out to every "
                       "replica (default: --port + 1)")
    serve.add_argument("--router-args", help="replicas: more sglang-router flags, one quoted string "
                       "(e.g. \"--cache-threshold 0.5 --prometheus-port 29000\")")
    dv = sub.add_parser("draft-vocab", help="an MTP draft vocabulary: token ids by frequency in text files "
                        "(for strategy.draft_vocab)")
    dv.add_argument("--config", required=True, help="engine YAML file (its tokenizer counts)")
    dv.add_argument("--size", type=int, default=32768, help="ids to keep (most frequent first)")
    dv.add_argument("--out", required=True, help="file to write (a JSON list of token ids)")
    dv.add_argument("texts", nargs="+", help="text files (one document each; .jsonl: one JSON string, or object "
                    "with a 'text' field, per line)")
    bench = sub.add_parser("bench", help="decode latency, throughput, prefill; several configs side by side")
    bench.add_argument("--config", action="append", required=True, help="repeat to compare configs in one run")
    bench.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=None, help=INVARIANT_HELP)
    bench.add_argument("--num-layers", type=int, help="cut a random preset to this many layers")
    bench.add_argument("--batch-sizes", default="1,8,64")
    bench.add_argument("--context-len", default="512", help="prompt length(s) of the decode runs, e.g. 512,3500")
    bench.add_argument("--steps", type=int, default=30)
    bench.add_argument("--throughput", default="256x512x256", help="REQUESTSxINPUTxOUTPUT, or 'none'")
    bench.add_argument("--prefill", default="8x2048", help="BATCHxLENGTH, or 'none'")
    bench.add_argument("--transformers", action="store_true", help="add transformers' generate as a baseline")
    bench.add_argument("--json", help="write all results to this file")
    return parser


def load_config(args: argparse.Namespace, path: str | None = None) -> EngineConfig:
    config = EngineConfig.from_yaml(path or args.config)
    if args.batch_invariant is not None:
        config = config.replace(policy={"batch_invariant": args.batch_invariant})
    layers = getattr(args, "num_layers", None)
    if layers is not None:
        if config.model.random is None:
            raise BiEngineError("--num-layers applies to model.random presets only")
        if layers < 1:
            raise BiEngineError(f"--num-layers: expected a positive int, got {layers}")
        config = config.replace(model={"random": attrs.evolve(config.model.random, num_hidden_layers=layers)})
    return config


VERIFY_FLAGS = {"num_prompts": "--num-prompts", "batch_sizes": "--batch-sizes", "max_new_tokens": "--max-new-tokens",
                "modes": "--modes", "mtp": "--strategies ar,mtp"}


def cmd_verify(args: argparse.Namespace) -> int:
    from bi_core import build_engine
    from bi_core.tools import verify

    config = load_config(args)
    max_num_seqs = config.scheduler.max_num_seqs
    if args.batch_sizes is None:
        batch_sizes = verify.default_batch_sizes(max_num_seqs)
        print(f"batch sizes: {','.join(map(str, batch_sizes))} (the defaults up to scheduler.max_num_seqs="
              f"{max_num_seqs})")
    else:
        batch_sizes = positive_ints(args.batch_sizes, "--batch-sizes")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    verify.check_plan(num_prompts=args.num_prompts, batch_sizes=batch_sizes, max_new_tokens=args.max_new_tokens,
                      modes=modes, max_num_seqs=max_num_seqs, names=VERIFY_FLAGS)
    if args.negative_control:
        config = verify.negative_control_config(config)
        print(f"negative control: backend {config.backend}, batch_invariant=false (mismatches expected)")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if strategies not in (["ar"], ["ar", "mtp"]):
        raise BiEngineError(f"--strategies: expected 'ar' or 'ar,mtp', got {args.strategies!r}")
    tp = config.parallel.tensor_parallel_size
    if "mtp" in strategies and tp > 1:
        raise BiEngineError("verify --strategies ar,mtp with parallel.tensor_parallel_size > 1 is not supported: the "
                            "audit forces MTP drafts on rank 0 only; audit MTP with tensor_parallel_size 1")
    engine = build_engine(config.replace(strategy={"name": "ar", "num_speculative_tokens": None}))
    mtp = None
    if "mtp" in strategies:
        n = config.strategy.num_speculative_tokens or 3
        mtp = build_engine(config.replace(strategy={"name": "mtp", "num_speculative_tokens": n}))
    cases = verify.audit(engine, num_prompts=args.num_prompts, batch_sizes=batch_sizes,
                         max_new_tokens=args.max_new_tokens, modes=modes, seed=args.seed, mtp_engine=mtp)
    print(verify.summary(cases))
    verify.check_drafts(cases, VERIFY_FLAGS)
    found = verify.count(cases)
    if found and tp == 1:  # the probes run the model on this process alone: not with tensor parallelism
        print(verify.probe(engine, cases, args.num_prompts, args.seed))
    if args.negative_control:
        print("negative control " + ("PASSED: the audit sees mismatches without invariance" if found else
                                     "FAILED: no mismatch found, so this audit cannot prove invariance here"))
        return 0 if found else 1
    print("PASS: bitwise batch-invariant" if not found else "FAIL: outputs depend on the batch")
    return 1 if found else 0


def cmd_serve(args: argparse.Namespace) -> int:
    config = load_config(args)
    if args.port is not None and not 0 <= args.port <= 65535:
        raise BiEngineError(f"--port: expected 0..65535, got {args.port}")
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port), ("api_key", args.api_key),
                                   ("admin_api_key", args.admin_api_key), ("dev_mode", args.dev_mode or None))
                 if v is not None}
    config = config.replace(serve=overrides) if overrides else config
    if args.data_parallel_size is not None:
        if args.data_parallel_size < 1:
            raise BiEngineError(f"--data-parallel-size: expected a positive int, got {args.data_parallel_size}")
        config = config.replace(parallel={"data_parallel_size": args.data_parallel_size})
    scale_flags = {"--ray-address": args.ray_address, "--router-policy": args.router_policy,
                   "--control-port": args.control_port, "--router-args": args.router_args}
    if config.parallel.data_parallel_size == 1:
        given = [flag for flag, value in scale_flags.items() if value is not None]
        if given:
            raise BiEngineError(f"{', '.join(given)}: only with replicas (--data-parallel-size or "
                                "parallel.data_parallel_size > 1)")
        from bi_core.serve import run_server

        return run_server(config)
    if args.dev_mode:
        raise BiEngineError("--dev-mode: with one server only (replicas take serve.dev_mode from the config file, "
                            "and the control front does not fan /collective_rpc out)")
    import shlex

    from bi_core.scale import ScaleOptions, run_replicas

    try:
        router_args = tuple(shlex.split(args.router_args or ""))
    except ValueError as e:
        raise BiEngineError(f"--router-args: {e}") from None
    options = ScaleOptions(data_parallel_size=config.parallel.data_parallel_size, ray_address=args.ray_address,
                           router_policy=args.router_policy or "cache_aware", control_port=args.control_port,
                           router_args=router_args)
    return run_replicas(args.config, config, options)


def cmd_bench(args: argparse.Namespace) -> int:
    from bi_core.tools.bench_report import run_bench

    configs = [load_config(args, path) for path in args.config]
    return run_bench(args, configs)


def _prompts(args: argparse.Namespace, config: EngineConfig) -> list:
    prompts: list = list(args.prompt)
    for i, text in enumerate(args.prompt_ids):
        prompts.append(token_ids(text, f"--prompt-ids[{i}]"))
    prompts = prompts or [list(p) if isinstance(p, tuple) else p for p in config.prompts]
    if not prompts:
        raise BiEngineError("no prompts: add a 'prompts' list to the config or pass --prompt / --prompt-ids")
    return prompts


def cmd_run(args: argparse.Namespace) -> int:
    from bi_core import SamplingParams, build_engine

    config = load_config(args)
    s = config.sampling
    overrides = {k: v for k, v in (("max_new_tokens", args.max_new_tokens), ("temperature", args.temperature),
                                   ("seed", args.seed), ("logprobs", args.logprobs)) if v is not None}
    s = attrs.evolve(s, **overrides)
    params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_k=s.top_k,
                            top_p=s.top_p, seed=s.seed, logprobs=s.logprobs, ignore_eos=s.ignore_eos)
    prompts = _prompts(args, config)
    engine = build_engine(config)
    outputs = engine.generate(prompts, params, progress=len(prompts) >= 8 and not args.json)
    if args.json:
        print(json.dumps([_as_dict(o) for o in outputs], indent=1))
        return _status(outputs)
    for i, (prompt, o) in enumerate(zip(prompts, outputs)):
        shown = prompt if isinstance(prompt, str) else f"<{len(prompt)} token ids>"
        if o.error:
            print(f"[{i}] {shown!r} -> ERROR: {o.error}")
            continue
        text = f"{o.text!r} " if o.text is not None else ""
        print(f"[{i}] {shown!r} -> {text}{o.token_ids} ({o.finish_reason}, {len(o.token_ids)} tokens)")
    return _status(outputs)


def _status(outputs) -> int:
    """1 when no request succeeded (every one failed validation), else 0."""
    if outputs and all(o.error for o in outputs):
        print("bi-engine: error: no request could be served (see the errors above)", file=sys.stderr)
        return 1
    return 0


def _as_dict(o) -> dict:
    d = attrs.asdict(o)
    if d["logprobs"] is not None:
        d["logprobs"] = [{str(k): v for k, v in step.items()} for step in d["logprobs"]]
    return d


def _draft_vocab_out(out: str):
    """``--out``: a file to write (new or replaced) in a directory that exists; checked before counting."""
    from pathlib import Path

    path = Path(out)
    if path.is_dir():
        raise BiEngineError(f"--out: {out} is a directory; name the file to write (e.g. {path / 'draft_vocab.json'})")
    if not path.parent.is_dir():
        raise BiEngineError(f"--out: directory {path.parent} does not exist (create it first)")
    return path


def _draft_texts(names: list[str]):
    """Each text file's documents (a .jsonl file: one per line, a JSON string or an object with a string 'text')."""
    from pathlib import Path

    for name in names:
        path = Path(name)
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise BiEngineError(f"{name}: cannot read it as text: {e}") from None
        if path.suffix != ".jsonl":
            yield content
            continue
        for n, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise BiEngineError(f"{name}:{n}: not JSON: {e.msg}") from None
            text = row.get("text") if isinstance(row, dict) else row
            if not isinstance(text, str):
                raise BiEngineError(f"{name}:{n}: expected a JSON string or an object with a string 'text' field")
            yield text


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    from bi_core.models.tokenizer import tokenizer_for
    from bi_core.strategies.draft_vocab import count_table

    if args.size < 1:
        raise BiEngineError(f"--size: expected a positive int, got {args.size}")
    out = _draft_vocab_out(args.out)
    config = EngineConfig.from_yaml(args.config)
    tokenizer = tokenizer_for(config.model)
    if tokenizer is None:
        raise BiEngineError(f"{args.config}: this model has no tokenizer to count with (model.path / model.tokenizer)")
    table = count_table(tokenizer, _draft_texts(args.texts), args.size)
    try:
        out.write_text(json.dumps(table))
    except OSError as e:
        raise BiEngineError(f"--out: cannot write {args.out}: {e.strerror or e}") from None
    print(f"{len(table)} token ids by frequency -> {args.out} (strategy.draft_vocab; strategy.draft_vocab_size "
          f"at most {len(table)})")
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from bi_core.plugins import load_registry
    from bi_core.runtime.build import explain

    config = load_config(args)
    registry = load_registry()
    if config.backend != "auto" and config.backend not in registry.backends:  # no table can help with a typo
        raise ConfigError("backend", f"unknown backend {config.backend!r}; registered: "
                                     f"{', '.join(sorted(registry.backends))} (or auto)")
    print(explain(config, registry))
    return 0


def cmd_plugins(args: argparse.Namespace) -> int:
    from bi_core.plugins import load_registry

    reg = load_registry()
    print("plugins:")
    for p in reg.plugins:
        print(f"  {p.name:<40} {p.distribution} {p.version}{'  (built-in)' if p.is_builtin else ''}")
    print("backends:")
    for name, b in sorted(reg.backends.items()):
        ops = ", ".join(x.op for x in b.builders)
        print(f"  {name:<24} from {reg.owners[name]}: {ops}")
    print("strategies:")
    for name in sorted(reg.strategies):
        print(f"  {name:<24} from {reg.owners['s:' + name]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in SUBCOMMANDS and not argv[0].startswith("-"):
        print(f"bi-engine: error: {argv[0]!r} is not a command; expected one of {', '.join(SUBCOMMANDS)} (or run's "
              "options, e.g. bi-engine --config FILE)", file=sys.stderr)
        return 2
    if argv and argv[0] not in SUBCOMMANDS and argv[0] not in ("-h", "--help"):
        argv.insert(0, "run")
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse's own errors (usage, exit 2) and --help (exit 0): returned, as ours are
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    try:
        commands = {"run": cmd_run, "explain": cmd_explain, "plugins": cmd_plugins, "verify": cmd_verify,
                    "bench": cmd_bench, "serve": cmd_serve, "draft-vocab": cmd_draft_vocab}
        return commands[args.command](args)
    except BiEngineError as e:
        print(f"bi-engine: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
