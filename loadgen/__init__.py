"""loadgen: load generator and reports for any OpenAI-compatible LLM server.

Modules: workloads (requests to send; `make_workload`), apps (application DAGs), arrivals
(arrival processes), trace (JSONL in/out), client (async streaming HTTP client), metrics
(`RequestRecord`, `build_results`: the results schema, also used by the simulator), report
(tables), plots (PNG figures), cli (`loadgen run|sweep|report|generate`).
"""

from loadgen.metrics import RequestRecord, build_results
from loadgen.workloads import Workload, WorkloadRequest, make_workload

__all__ = ["RequestRecord", "Workload", "WorkloadRequest", "build_results", "make_workload"]
