"""`raycluster engine-server`: one engine in this process (no Ray) behind the OpenAI API, under
uvicorn. `serve_engine(args)` takes the parsed command line (raycluster.cli's parser), builds the
engine from the engine flags, and runs until interrupted; it returns the exit code."""

from __future__ import annotations

import argparse
import logging
import sys

from raycluster.engine_flags import engine_overrides
from raycluster.server.response_store import LocalResponses, ResponseStore


def _stderr_handler() -> logging.Handler:
    h = logging.StreamHandler()
    h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    return h


def serve_engine(args: argparse.Namespace) -> int:
    """Serve one engine (no Ray) over the OpenAI API under uvicorn until interrupted."""
    import uvicorn

    from raycluster.engine.config import EngineConfig
    from raycluster.engine.engine import LLMEngine
    from raycluster.engine.stat_log import StatLogger
    from raycluster.model.generation_config import load_generation_config
    from raycluster.model.registry import default_model_name, resolve_model_path
    from raycluster.server.app import build_app
    from raycluster.server.async_engine import AsyncEngine
    from raycluster.server.auth import keys_from_env
    from raycluster.server.images import image_limit, image_spec_for

    cfg = EngineConfig(**{**engine_overrides(args), "model": args.model, "policy": args.policy,
                          "num_threads": args.threads, "enable_prefix_caching": args.enable_prefix_caching})
    engine = LLMEngine.from_config(cfg)
    stats = None
    if args.log_stats_interval > 0:
        log = logging.getLogger("raycluster.stats")
        log.addHandler(_stderr_handler())
        log.setLevel(logging.INFO)
        stats = StatLogger("engine", args.log_stats_interval, log.info)
    if args.chat_template:
        engine.tokenizer.set_chat_template(args.chat_template)
    async_engine = AsyncEngine(engine, stat_logger=stats)
    names = args.served_model_name or [default_model_name(args.model)]
    name = names[0]
    defaults = load_generation_config(resolve_model_path(args.model)).sampling \
        if args.generation_config == "auto" else None
    try:
        app = build_app(async_engine, engine.tokenizer, names, api_keys=keys_from_env(),
                        tool_call_parser=args.tool_call_parser, sampling_defaults=defaults,
                        log_requests=args.enable_log_requests, reasoning_parser=args.reasoning_parser,
                        lora_resolver_max_loaded=args.lora_resolver_max_loaded, model_config=engine.model.config,
                        response_store=LocalResponses(ResponseStore(args.max_stored_responses)),
                        images=image_spec_for(resolve_model_path(cfg.model, cfg.hf_overrides), engine.tokenizer)
                        if engine.image_encoder else None, max_images=image_limit(args.limit_mm_per_prompt),
                        max_videos=image_limit(args.limit_mm_per_prompt, "video"), mm_embeds=args.enable_mm_embeds,
                        allowed_local_media_path=args.allowed_local_media_path)
    except ValueError as e:             # a setting that does not hold together, named in the message
        async_engine.shutdown()
        print(f"raycluster engine-server: {e}", file=sys.stderr)
        return 2
    if defaults:
        print(f"raycluster: default sampling parameters from the model's generation_config.json: {defaults}",
              flush=True)
    print(f"raycluster: serving {name} on http://{args.host}:{args.port} (policy {args.policy})", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    finally:
        async_engine.shutdown()
    return 0
