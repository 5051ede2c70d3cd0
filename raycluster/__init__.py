"""raycluster: a Ray-based, prefill/decode-disaggregated LLM serving cluster.

The core library (this package) has no `ray.serve` import: request and SLO types, the model,
the paged KV cache, the engine, scheduling policies and the CLI. `deployments/` wraps it in Ray
Serve; `kernels/` holds attention kernels; `loadgen/` drives any OpenAI-compatible endpoint.
"""

__version__ = "0.1.0"
