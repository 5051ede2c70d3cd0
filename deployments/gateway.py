"""The HTTP ingress: FastAPI (OpenAI routes from raycluster.server.app) over a `ClusterClient`.

Serve builds the ASGI app on each replica from `build_gateway_app`, which reads the cluster
config from the replica's environment (`RAYCLUSTER_CLUSTER_CONFIG`, set by the app builder),
loads the tokenizer (prompts are tokenized here, once) and connects to the named router.
"""

from __future__ import annotations

import asyncio
import os

import ray
from fastapi import Request
from fastapi.responses import JSONResponse
from ray import serve

from deployments import direct_ingress
from deployments.gateway_metrics import RayRequestMetrics
from raycluster.cluster.client import ClusterClient, LoRACalls
from raycluster.cluster.config import ClusterConfig
from raycluster.server.auth import keys_from_env
from raycluster.server.protocol import error_body
from raycluster.server.response_store import RemoteResponses

CONFIG_ENV = "RAYCLUSTER_CLUSTER_CONFIG"


def build_gateway_app():
    from raycluster.model.config import model_summary
    from raycluster.model.loader import load_config
    from raycluster.model.generation_config import load_generation_config
    from raycluster.model.registry import resolve_model_path
    from raycluster.model.tokenizer import Tokenizer
    from raycluster.server.app import build_app
    from raycluster.server.images import image_limit, image_spec_for

    cfg = ClusterConfig.model_validate_json(os.environ[CONFIG_ENV])
    path = resolve_model_path(cfg.model, cfg.engine_config(cfg.pools[0]).hf_overrides)
    mcfg = load_config(path)       # with what the tensor names say (a checkpoint without an output head)
    tokenizer = Tokenizer(path, mcfg.eos_token_id)
    if cfg.chat_template:
        tokenizer.set_chat_template(cfg.chat_template)
    router = ray.get_actor(cfg.router_name, namespace=cfg.namespace)
    try:
        ctx = serve.get_replica_context()
        gateway_id, app_name = "gw-" + ctx.replica_id.unique_id, ctx.app_name
    except Exception:       # outside a replica (tests building the app directly)
        gateway_id = app_name = None
    max_len = min(cfg.engine_config(p).max_model_len or mcfg.max_model_len for p in cfg.pools)
    client = ClusterClient(
        submit=lambda meta: router.submit.remote(meta), abort=lambda rid: router.abort.remote(rid),
        pull=lambda gid, timeout: router.pull.remote(gid, timeout), status=lambda: router.status.remote(),
        tokenizer=tokenizer, max_model_len=min(max_len, mcfg.max_model_len), vocab_size=mcfg.vocab_size,
        eos_token_ids=tokenizer.eos_token_ids, gateway_id=gateway_id, lora_modules=cfg.lora_modules(),
        lora=LoRACalls(names=lambda: router.lora_adapters.remote(),
                       load=lambda name, path: router.load_lora.remote(name, path),
                       unload=lambda name: router.unload_lora.remote(name)),
        # Pixels go by handle: the router and the instances a request visits pass a few bytes.
        share_images=ray.put)
    names = cfg.served_names()
    # The key comes from the replica's environment (its node's), never from the Serve config.
    # In a replica its request metrics also go to Ray's metrics export (summable over replicas).
    sinks = [RayRequestMetrics(gateway_id)] if gateway_id is not None else []
    defaults = load_generation_config(path).sampling if cfg.generation_config == "auto" else None
    # Images are loaded and preprocessed here, once; the instances encode them.
    images = image_spec_for(path, tokenizer)
    app = build_app(client, tokenizer, names, api_keys=keys_from_env(), tool_call_parser=cfg.tool_call_parser,
                    metrics_sinks=sinks, sampling_defaults=defaults, log_requests=cfg.log_requests,
                    reasoning_parser=cfg.reasoning_parser, request_id_header=False,
                    allow_runtime_lora=cfg.allow_runtime_lora_updating, lora_resolver_dir=cfg.lora_resolver_dir,
                    lora_resolver_max_loaded=cfg.lora_resolver_max_loaded, model_config=mcfg, images=images,
                    max_images=image_limit(cfg.limit_mm_per_prompt),
                    max_videos=image_limit(cfg.limit_mm_per_prompt, "video"), mm_embeds=cfg.enable_mm_embeds,
                    allowed_local_media_path=cfg.allowed_local_media_path,
                    response_store=RemoteResponses(
                        put=lambda rid, record: router.put_response.remote(rid, record),
                        get=lambda rid: router.get_response.remote(rid),
                        delete=lambda rid: router.delete_response.remote(rid),
                        cancel=lambda rid: router.cancel_response.remote(rid),
                        statuses=lambda rids: router.response_statuses.remote(rids),
                        append_events=lambda rid, events, done: router.append_response_events.remote(rid, events, done),
                        events_after=lambda rid, after: router.response_events_after.remote(rid, after),
                        enabled=cfg.max_stored_responses > 0))

    @app.get("/v1/cluster/status")
    async def cluster_status(request: Request):
        try:
            status = dict(await client.refresh_status())
        except Exception as e:          # the router is restarting (or gone): say so, not 500
            return JSONResponse(error_body(f"router unavailable: {e}", None, "unavailable", "unavailable"),
                                status_code=503, headers={"Retry-After": "1"})
        status["model"] = {"name": names[0], **model_summary(mcfg)}
        if images is not None:          # an image-text checkpoint served with its images
            status["model"].update(text_only=False, images=True)
        if app_name is not None:        # each replica's own port (Serve direct ingress), if on
            status["gateway_urls"] = await asyncio.to_thread(
                direct_ingress.urls, app_name, request.url.hostname or "127.0.0.1")
        return status

    return app


@serve.deployment(max_ongoing_requests=2000)
@serve.ingress(build_gateway_app)
class Gateway:
    def __init__(self, *pools) -> None:
        # The pool handles are bound here only so Serve deploys them as part of this app.
        self._pools = pools
