"""LoRA adapters loaded and unloaded at run time over HTTP (vLLM's runtime LoRA updating).

`POST /v1/load_lora_adapter` `{"lora_name": ..., "lora_path": ...}` and
`POST /v1/unload_lora_adapter` `{"lora_name": ...}`, registered only when allowed: the
`allow` argument, or vLLM's environment variable `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set to a
true value (as in vLLM, the routes do not exist otherwise). Answers as vLLM's: 200 with a
plain-text "Success: ..." line; 400 for a name already served (or naming the base model), an
adapter this model cannot serve, or a missing field; 404 for no adapter at the path, or an
unload of a name that is not served.

The backend does the work: `load_lora(name, path)` and `unload_lora(name)`, raising
`AdapterError` / `AdapterNotFound` (raycluster.model.lora) with the message to return. One
engine (`AsyncEngine`) reads the files off its step thread and adds the adapter between steps;
the cluster (`ClusterClient`) asks the router, which has every instance load it and answers
once all have (or, if one cannot, unloads it everywhere and returns that one's error). An
unloaded adapter serves no new request; requests running on it finish on it.
"""

from __future__ import annotations

import logging
import os
from typing import Sequence

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict

from raycluster.model.lora import AdapterError, AdapterNotFound
from raycluster.server.protocol import error_body

RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
log = logging.getLogger(__name__)


def runtime_lora_allowed(allow: bool | None = None) -> bool:
    """`allow` if given, else vLLM's environment variable (true / 1 / yes, any case)."""
    if allow is not None:
        return allow
    return os.environ.get(RUNTIME_LORA_ENV, "").strip().lower() in ("1", "true", "yes")


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_int_id: int | None = None      # vLLM's; names are what this server goes by


def _error(e: AdapterError, param: str) -> JSONResponse:
    status = 404 if isinstance(e, AdapterNotFound) else 400
    return JSONResponse(error_body(str(e), param, "NotFoundError" if status == 404 else "BadRequestError",
                                   code=str(status)), status_code=status)


def add_lora_routes(app: FastAPI, engine, served_names: Sequence[str]) -> None:
    """The two routes over `engine` (see the module docstring); `served_names` are the base
    model's names, which no adapter may take."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        name, path = body.lora_name.strip(), body.lora_path.strip()
        if not name or not path:
            field = "lora_name" if not name else "lora_path"
            return _error(AdapterError("both 'lora_name' and 'lora_path' must be provided"), field)
        if name in served_names:
            return _error(AdapterError(f"lora_name: {name!r} names the base model"), "lora_name")
        try:
            await engine.load_lora(name, path)
        except AdapterError as e:
            return _error(e, "lora_path" if isinstance(e, AdapterNotFound) else "lora_name")
        log.info("loaded LoRA adapter %r from %s", name, path)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        name = body.lora_name.strip()
        if not name:
            return _error(AdapterError("'lora_name' must be provided"), "lora_name")
        try:
            await engine.unload_lora(name)
        except AdapterError as e:
            return _error(e, "lora_name")
        log.info("unloaded LoRA adapter %r", name)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
