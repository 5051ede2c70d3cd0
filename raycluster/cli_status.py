"""`raycluster status`: asks the running gateway for the cluster's status and prints it as a table
(the served model, pools, instances, queues, KV usage, KV pulls, controller moves), or as JSON with `--json`. The
gateway's URL comes from `--url`, else from what `up --detach` recorded, else 127.0.0.1:8000;
the API key, if the gateway wants one, from RAYCLUSTER_API_KEY."""

from __future__ import annotations

import argparse
import json
import sys

from raycluster.cli_state import pid_file
from raycluster.server.auth import API_KEY_ENV, bearer_headers


def cmd_status(args: argparse.Namespace) -> int:
    import httpx

    url = args.url
    if url is None:
        pf = pid_file()
        url = json.loads(pf.read_text())["url"] if pf.exists() else "http://127.0.0.1:8000"
    try:
        resp = httpx.get(url.rstrip("/") + "/v1/cluster/status", timeout=10, headers=bearer_headers())
        if resp.status_code == 401:
            print(f"raycluster: {url} wants an API key: set {API_KEY_ENV}", file=sys.stderr)
            return 1
        status = resp.json()
    except httpx.HTTPError as e:
        print(f"raycluster: no cluster answers at {url} ({e})", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(format_status(status))
    return 0


def model_line(m: dict) -> str:
    """The served model in one line: name, architecture, tasks, pooling, weights."""
    pool = m.get("pooling") or {}
    pooling = f"{pool.get('type')} pooling" + (", normalised" if pool.get("normalize") else "") + \
        "".join(f", {d}" for d in pool.get("dense", [])) + f", {pool.get('size')} dims"
    labels = f" labels {', '.join(m['labels'])};" if m.get("labels") else ""
    arch = f"{m.get('architecture')}" + (", text only" if m.get("text_only") else "") + \
        (", takes images" if m.get("images") else "")
    return (f"model {m.get('name')} ({arch}): {' + '.join(m.get('tasks', []))};{labels} "
            f"{pooling}; weights {m.get('weights')} ({m.get('dtype') or 'float32'})")


def format_status(status: dict) -> str:
    """`raycluster status`'s table, from the router's status JSON."""
    lines = [f"policy {status.get('policy')}   in flight {status.get('inflight')}   queues {status.get('queues')}   "
             f"router {status.get('router_id')}"
             + (f"   stored responses {status['stored_responses']}" if "stored_responses" in status else "")]
    if status.get("model"):
        lines.append(model_line(status["model"]))
    if status.get("gateway_urls"):
        lines.append(f"gateway replicas (no proxy hop): {', '.join(status['gateway_urls'])}")
    if status.get("lora_adapters") or status.get("lora_loading"):
        lines.append("LoRA adapters: " + (", ".join(f"{n} ({p})" for n, p in status.get("lora_adapters", {}).items())
                                          or "none") + "".join(f"; loading {n}" for n in status.get("lora_loading", [])))
    lines.append(f"{'instance':28s} {'role':14s} {'scheduling':18s} {'waiting':>8s} {'prefill tok':>11s} "
                 f"{'running':>8s} {'kv used':>8s} {'prefix hits':>11s}")
    for inst in status.get("instances", []):
        total = max(1, inst.get("kv_total_blocks", 0))
        used = 1 - inst.get("kv_free_blocks", 0) / total
        role = inst.get("role", "?") + ("" if inst.get("layout", "single") == "single" else f" {inst['layout']}")
        hits = (f"{inst.get('prefix_hit_tokens', 0) / max(1, inst.get('prefix_query_tokens', 0)):11.1%}"
                if inst.get("prefix_caching") else f"{'off':>11s}")
        lines.append(f"{inst.get('id', '?'):28s} {role:14s} {inst.get('scheduling') or '?':18s} "
                     f"{inst.get('waiting', 0):8d} {inst.get('queued_tokens', 0):11d} {inst.get('running', 0):8d} "
                     f"{used:8.1%} {hits}")
        ok, failed = inst.get("kv_pulls_ok", 0), inst.get("kv_pulls_failed", 0)
        if ok or failed:            # a decode instance's KV handoffs: moved vs recomputed, and their cost
            per_pull = f", {inst.get('kv_pull_s', 0.0) / ok * 1e3:.1f} ms per pull" if ok else ""
            lines.append(f"  kv pulls: {ok} ok ({inst.get('kv_pull_blocks', 0)} blocks{per_pull}), "
                         f"{failed} failed and recomputed")
        groups, released = inst.get("kv_groups", 1), inst.get("kv_released_blocks", 0)
        if groups > 1 or released:  # a sliding-window model's KV: tables per layer group, blocks given back
            lines.append(f"  kv cache: {f'hybrid, {groups} layer groups' if groups > 1 else 'one table'}, "
                         f"{released} blocks given back out of the window")
        drafts = inst.get("spec_draft_tokens", 0)
        if drafts:                  # speculative decoding: how many drafts the model agreed with
            runs, per_pos = inst.get("spec_drafts", 0), inst.get("spec_accepted_per_pos") or []
            by_pos = f"; by position {' '.join(f'{c / runs:.0%}' for c in per_pos)}" if runs and per_pos else ""
            lines.append(f"  draft tokens: {drafts}, {inst.get('spec_accepted_tokens', 0) / drafts:.1%} accepted"
                         f"{by_pos}")
        for name, error in (inst.get("lora_failed") or {}).items():
            lines.append(f"  LoRA adapter {name} not loaded: {error}")
        nodes = inst.get("nodes") or []
        if len(set(nodes)) > 1:     # a group spanning nodes: where each rank runs (Ray node ids)
            lines.append("  ranks on nodes: " + ", ".join(f"{r}:{n[:8]}" for r, n in enumerate(nodes)))
    ctl = status.get("controller")
    if ctl is not None:
        moves = ctl.get("moves", [])
        lines.append(f"pressure controller every {ctl.get('period_s')} s: {len(moves)} recent move(s)"
                     + "".join(f"\n  {m['instance']}: {m['from']} -> {m['to']}" for m in moves))
    return "\n".join(lines)
