"""The engine of one instance: validate and admit requests, run step after step, emit outputs.

`add_request` turns a prompt (token ids) and sampling parameters into a `Request` owned by the
scheduler; `step()` asks the scheduler what to run, runs it through the model runner, samples
(and, with speculative decoding, verifies each drafting decode's rows, then proposes the next
drafts: raycluster.engine.spec_decode), detokenizes incrementally (stop strings), and returns a
`StepResult` with one `RequestOutput` per request that produced tokens or finished (those types
and the request checks live in raycluster.engine.outputs).
`abort_request` frees a request's blocks at once. LoRA adapters (`lora_modules`) are loaded here
and handed to the runner; a request names one in `SamplingParams.lora_adapter`. Adapters also
come and go at run time: `read_lora` (any thread: reads the files), then `lora.add`;
`unload_lora` stops new requests using one and drops it when the last running one ends.
Single-threaded: callers serialise access (the async server runs steps on one thread).
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import torch

from raycluster.clock import WallClock
from raycluster.engine.config import EngineConfig
from raycluster.engine.guided import GuidedDecoding, constraint_of
from raycluster.engine.image_inputs import EncoderCache, check_request_images, request_image_fields
from raycluster.engine.outputs import InvalidRequestError, RequestOutput, StepResult, validate_request
from raycluster.parallel.factory import build_runner
from raycluster.engine.sampler import Sampler
from raycluster.engine.spec_decode import SpecDecodeCounts, build_proposer
from raycluster.model.lora import LoRAAdapter, LoRASet, load_adapter, parse_modules
from raycluster.model.pooling import TOKEN_POOLING
from raycluster.engine.pooling_head import PoolingHead
from raycluster.engine.profiler import load_or_profile
from raycluster.engine.sched_factory import RetiredScheduling, build_scheduler, needs_predictor
from raycluster.engine.text import TextStream
from raycluster.request import SLO, Request, RequestStatus, SamplingParams, TokenLogprob
from raycluster.sched.base import Clock
from raycluster.sched.predictor import LinearBatchPredictor

__all__ = ["InvalidRequestError", "LLMEngine", "RequestOutput", "StepResult", "validate_request"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _min_tokens_ban(req: Request) -> list[int]:
    """What min_tokens holds back: the EOS ids (unless ignore_eos) and stop_token_ids."""
    sp = req.sampling
    return [*(() if sp.ignore_eos else req.eos_token_ids), *sp.stop_token_ids] if sp.min_tokens else []


class LLMEngine:
    def __init__(self, config: EngineConfig, model, tokenizer=None, clock: Clock | None = None,
                 predictor: LinearBatchPredictor | None = None, runner=None,
                 pooling_head: PoolingHead | None = None, image_encoder=None) -> None:
        """`runner`: a prebuilt runner (e.g. a KVP / SPP / TP group whose ranks are Ray actors);
        default one built from `config` (raycluster.parallel.factory). `pooling_head`: what pooled
        vectors go through (default the model's own head and Dense modules; a group's leader
        holds neither: `from_runner` reads them from the checkpoint). `model`: what the engine
        reads its vocab, length and EOS from (`model.config`): the full model, or the
        `GroupModel` of a prebuilt group whose ranks read their parts from the checkpoint.
        `image_encoder`: an image-text checkpoint's (raycluster.model.llava), for prompts with
        images; the runner's leader runs it."""
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        config = config.for_model(getattr(model.config, "dtype", None))
        if model.config.is_encoder:
            config = config.for_encoder()
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.clock = clock or WallClock()
        mcfg = model.config
        self.max_model_len = min(config.max_model_len or mcfg.max_model_len, mcfg.max_model_len)
        self.vocab_size = mcfg.vocab_size
        # How pooling requests (/v1/embeddings) pool their prompt (raycluster.model.pooling).
        self.pooling_type = mcfg.pooler.pooling_type if config.pooling_type == "auto" else config.pooling_type
        # What a pooled vector becomes: a classifier's logits, an embedding's Dense projections, itself.
        self.pooling_head = pooling_head or PoolingHead(model, _DTYPES[config.dtype])
        self.classifier, self.projector = self.pooling_head.classifier, self.pooling_head.projector
        self.eos_token_ids = tuple(tokenizer.eos_token_ids) if tokenizer is not None else tuple(mcfg.eos_token_id)
        self.runner = runner or build_runner(config, model, _DTYPES[config.dtype])
        self.kv = self.runner.kv
        self.image_encoder = self.runner.image_encoder = image_encoder
        if image_encoder is not None and config.encoder_cache_tokens > 0:
            self.runner.image_cache = EncoderCache(config.encoder_cache_tokens)
        self.predictor = predictor or self._predictor(config)
        self.scheduler = build_scheduler(config, self.kv, self.clock, self.max_model_len, self.predictor)
        if self.runner.image_cache is not None:
            self.scheduler.encoder_cached = self.runner.image_cache
        self._retired = RetiredScheduling()       # pieces of pools it left (reconfigure_scheduling)
        self.sampler = Sampler(config.seed)
        # LoRA adapters served beside the base weights; a group's ranks each hold their shards.
        self.lora = self.runner.lora = LoRASet(on_change=getattr(self.runner, "change_lora", None))
        for name, path in parse_modules(config.lora_modules).items():
            self.lora.add(load_adapter(path, mcfg, name, _DTYPES[config.dtype]))
        if self.kv.prefix_caching:
            self.kv.lora_roots = self.lora.roots
        self.spec = SpecDecodeCounts(config.num_speculative_tokens)     # speculative decoding, so far
        self.proposer = build_proposer(config, model, self.runner, _DTYPES[config.dtype])
        self._texts: dict[str, TextStream] = {}
        self._guided: GuidedDecoding | None = None     # built at the first structured-output request
        self._guided_lock = threading.Lock()            # compile threads may build it too

    def _predictor(self, cfg: EngineConfig) -> LinearBatchPredictor | None:
        if cfg.predictor == "none" or not needs_predictor(cfg):
            return None
        if cfg.predictor == "auto":
            return load_or_profile(self.runner, self.max_model_len, cfg.max_num_batched_tokens, cfg.max_num_seqs)
        return LinearBatchPredictor(**json.loads(Path(cfg.predictor).read_text())["predictor"])

    def reconfigure_scheduling(self, pool: EngineConfig) -> bool:
        """Schedule from now on as an engine of `pool`'s config does (the pressure controller
        moved this instance there): its policy, packer, decode selector and limits
        (`EngineConfig.with_scheduling_of`; model, KV and parallelism stay ours). Call it between
        steps, on the thread that steps. Every request stays (`Scheduler.reconfigure`); a
        predictor the new pieces need and this engine lacks is obtained as at start. The pieces
        left behind are kept for a return (`RetiredScheduling`). Returns whether anything changed."""
        cfg = self.config.with_scheduling_of(pool)
        if self.model.config.is_encoder:
            cfg = cfg.for_encoder()
        if cfg == self.config:
            return False
        if self.predictor is None:
            self.predictor = self._predictor(cfg)
        self._retired.switch(self.scheduler, self.config, cfg, self.clock, self.max_model_len, self.predictor)
        self.config = cfg
        return True

    @classmethod
    def from_config(cls, config: EngineConfig, clock: Clock | None = None) -> "LLMEngine":
        from raycluster.model.registry import resolve_model_path
        from raycluster.model.tokenizer import Tokenizer
        from raycluster.parallel.factory import model_source

        from raycluster.model.loader import load_config

        path = resolve_model_path(config.model, config.hf_overrides)
        config = config.for_model(load_config(path).dtype)
        model = model_source(config, str(path))
        runner = build_runner(config, model, _DTYPES[config.dtype], model_path=str(path))
        return cls.from_runner(config, runner, str(path), Tokenizer(path, model.config.eos_token_id), clock)

    @classmethod
    def from_runner(cls, config: EngineConfig, runner, path: str, tokenizer=None,
                    clock: Clock | None = None) -> "LLMEngine":
        """An engine over a built runner of the checkpoint at `path` (its model: the full model,
        or the group's view of it). A group's leader holds neither a classifier's head nor an
        embedding's Dense modules: they are read from the checkpoint here."""
        from raycluster.model.llava import image_encoder_for

        head = PoolingHead.for_runner(runner, path, _DTYPES[config.dtype], config.device)
        images = image_encoder_for(path, _DTYPES[config.dtype], config.device)
        return cls(config, runner.model, tokenizer, clock, runner=runner, pooling_head=head, image_encoder=images)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    sampling: SamplingParams | None = None, *, slo: SLO | None = None,
                    priority: int = 0, tenant: str = "default", app_id: str | None = None,
                    arrival_time: float | None = None, prefill_only: bool = False,
                    output_token_ids: list[int] | None = None) -> Request:
        """`output_token_ids`: tokens already generated elsewhere (a resumed request, or a decode
        whose KV could not be pulled); they are recomputed with the prompt, then generation goes on."""
        req = self._new_request(request_id, prompt_token_ids, sampling, slo, priority, tenant, app_id,
                                arrival_time, output_token_ids)
        req.prefill_only = prefill_only
        self.scheduler.add_request(req)
        self._track_text(req)
        return req

    def add_prefilled(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int],
                      sampling: SamplingParams | None, fill_kv, *, slo: SLO | None = None,
                      priority: int = 0, tenant: str = "default", app_id: str | None = None,
                      arrival_time: float | None = None, first_token_time: float | None = None) -> bool:
        """Decode side of a P/D handoff: `output_token_ids` are the tokens sampled so far (the
        first one, or more on a resumed request); reserve blocks for the KV of every token but
        the last, let `fill_kv(block_ids, skip_blocks)` bring it (True on success; the first
        `skip_blocks` source blocks are in this engine's prefix cache already and `block_ids` are
        for the rest), and admit the request straight into decoding. Without blocks or when the
        transfer fails, the request is queued to recompute its prefill here instead; returns
        whether the KV was used.
        `first_token_time` (this engine's clock): when the client got the first token, made
        elsewhere."""
        req = self._new_request(request_id, prompt_token_ids, sampling, slo, priority, tenant, app_id,
                                arrival_time, output_token_ids)
        req.first_token_time = first_token_time
        admitted = self.scheduler.admit_prefilled(req)
        if admitted is not None:
            blocks, skip = admitted
            if not blocks or fill_kv(list(blocks), skip):     # all cached here: nothing to move
                self.scheduler.kv_arrived(req)
                self._track_text(req)
                return True
            self.scheduler.cancel_admission(req)
        self.scheduler.add_request(req)
        self._track_text(req)
        return False

    def adopt_parked(self, request_id: str) -> bool:
        """Decode a parked request here, on the KV it already has (`Scheduler.adopt_parked`)."""
        return self.scheduler.adopt_parked(request_id) is not None

    def release(self, request_id: str) -> bool:
        """Free a parked prefill-only request's KV (the decode side has it, or nobody came)."""
        return self.scheduler.release(request_id) is not None

    def parked_blocks(self, request_id: str) -> list[int] | None:
        if request_id not in self.scheduler.parked:
            return None
        return self.kv.handoff_table(request_id)

    def _new_request(self, request_id, prompt_token_ids, sampling, slo, priority, tenant, app_id,
                     arrival_time, output_token_ids) -> Request:
        sampling = sampling or SamplingParams()
        self._validate(prompt_token_ids, sampling)
        images = request_image_fields(sampling, self.image_encoder, self.runner, self.model.config.mrope is not None,
                                      self.scheduler.config.max_num_batched_tokens)
        return Request(request_id=request_id, prompt_token_ids=list(prompt_token_ids), sampling=sampling, **images,
                       arrival_time=self.clock.now() if arrival_time is None else arrival_time,
                       slo=slo or SLO(), priority=priority, tenant=tenant, app_id=app_id,
                       expected_output_tokens=sampling.max_tokens, eos_token_ids=self.eos_token_ids,
                       output_token_ids=list(output_token_ids or []),
                       pooling=(TOKEN_POOLING if sampling.pool_tokens else self.pooling_type) if sampling.embed else None)

    def _track_text(self, req: Request) -> None:
        if self.tokenizer is not None:
            self._texts[req.request_id] = TextStream.of(self.tokenizer, req.prompt_token_ids, req.sampling)

    def _validate(self, ids: list[int], sp: SamplingParams) -> None:
        validate_request(ids, sp, self.max_model_len, self.vocab_size, self.kv.capacity_tokens())
        check_request_images(ids, sp, self.image_encoder, self.scheduler.config.max_num_encoder_tokens)
        if sp.lora_adapter is not None and sp.lora_adapter not in self.lora:
            raise InvalidRequestError("model", f"LoRA adapter {sp.lora_adapter!r} is not served here")
        if sp.embed and not sp.pool_tokens and self.model.config.token_classifier:
            raise InvalidRequestError("model", "this model classifies each token (a *ForTokenClassification): "
                                      "ask /pooling with task token_classify")
        if not sp.embed and not self.model.config.has_lm_head:
            raise InvalidRequestError("model", "this checkpoint has no output head (lm_head.weight): it serves "
                                      "the pooling routes (/v1/embeddings, /pooling, /score, /rerank, /classify) "
                                      "only, not text generation")
        if sp.embed and not hasattr(type(self.runner), "keep_hidden"):
            raise InvalidRequestError("input", f"embeddings are not served by a {self.runner.layout} group "
                                      "(its pipeline stages do not return the final hidden states)")
        constraint = constraint_of(sp)
        if constraint is not None:
            try:
                self.guided_decoding().index(constraint)
            except ValueError as e:
                raise InvalidRequestError(constraint.field, str(e)) from None

    def pattern_ready(self, sp: SamplingParams) -> bool:
        """Whether `sp`'s structured-output constraint, if any, is compiled already (admitting a
        request with it costs no compile)."""
        constraint = constraint_of(sp)
        return constraint is None or self._guided is not None and self._guided.compiled(constraint)

    def guided_decoding(self) -> GuidedDecoding:
        """The structured-output state; its vocabulary comes from the engine's tokenizer or, for
        an engine that serves token ids only (a cluster instance), the checkpoint's."""
        with self._guided_lock:
            if self._guided is None:
                tok = self.tokenizer
                if tok is None:
                    from raycluster.model.registry import resolve_model_path
                    from raycluster.model.tokenizer import Tokenizer
                    tok = Tokenizer(resolve_model_path(self.config.model, self.config.hf_overrides),
                                    self.eos_token_ids)
                self._guided = GuidedDecoding(tok.token_bytes(), self.eos_token_ids,
                                              tokenizer_json=tok.to_json(), vocab_size=self.vocab_size)
            return self._guided

    def close(self) -> None:
        """Stop the runner's group ranks, if any (a single-process runner holds nothing)."""
        self.runner.close()

    def abort_request(self, request_id: str) -> bool:
        self._texts.pop(request_id, None)
        self._forget(request_id)
        return self.scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step loop ---------------------------------------------------------------------
    def step(self) -> StepResult:
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        result = StepResult(num_prefill_tokens=out.num_prefill_tokens, num_decode_tokens=len(out.decodes),
                            num_preempted=len(out.preempted))
        sampled_reqs: list[Request] = []
        tokens: list[int] = []
        logprobs: dict[str, TokenLogprob] = {}
        accepted: dict[str, list[int]] = {}
        drafted: list[tuple[Request, int, list[TokenLogprob] | None]] = []   # (req, outputs before, lps)
        pooled: list[Request] = []          # pooling requests whose prompt this step completed
        if not out.is_empty:
            step = self.runner.execute(out)
            if step.requests:
                sampled_reqs = step.requests
                params = [r.sampling for r in sampled_reqs]
                logits = step.logits
                if any(p.penalized for p in params):        # rare: keep the plain step cheap
                    logits = self.sampler.penalize(
                        logits, params, [r.prompt_token_ids for r in sampled_reqs],
                        [r.output_token_ids for r in sampled_reqs], [_min_tokens_ban(r) for r in sampled_reqs])
                constraints = [constraint_of(p) for p in params]
                guided = [i for i, c in enumerate(constraints) if c is not None]
                if guided:
                    logits = self._guided.mask(logits, guided, [sampled_reqs[i].request_id for i in guided],
                                               [constraints[i] for i in guided],
                                               [sampled_reqs[i].output_token_ids for i in guided],
                                               raw=None if logits is step.logits else step.logits)
                tokens = self.sampler.sample(logits, params, [len(r.output_token_ids) for r in sampled_reqs])
                for i in guided:
                    self._guided.advance(sampled_reqs[i].request_id, tokens[i])
                rows = [i for i, r in enumerate(sampled_reqs) if r.sampling.logprobs is not None]
                if rows:
                    lps = self.sampler.logprobs(step.logits, rows, [tokens[i] for i in rows],
                                                [sampled_reqs[i].sampling.logprobs for i in rows])
                    logprobs = {sampled_reqs[i].request_id: lp for i, lp in zip(rows, lps)}
            for req, vector in step.embeddings:
                req.embedding = self.pooling_head(vector).tolist()
                pooled.append(req)
            for req, first, rows_logits in step.prompt:
                self._record_prompt_logprobs(req, first, rows_logits)
            for req, rows_logits in step.drafts:
                drafts = out.spec_tokens[req.request_id]
                toks, lps = self._verify_drafts(req, drafts, rows_logits)
                accepted[req.request_id] = toks
                drafted.append((req, len(req.output_token_ids), lps))
                result.num_draft_tokens += len(drafts)
                result.num_accepted_tokens += len(toks) - 1
                self.spec.add(len(drafts), len(toks) - 1)
        sampled = {r.request_id: t for r, t in zip(sampled_reqs, tokens)}
        if self.proposer is not None:
            self.proposer.observe(out, sampled, accepted)
        finished = {r.request_id for r in self.scheduler.update(out, sampled, accepted)}
        for req in out.finished:
            finished.add(req.request_id)
            result.outputs.append(self._output(req, [], True, self._flush(req.request_id)))
        for req in pooled:
            if req.request_id in finished:          # its vector, no token (aborted: out.finished's)
                result.outputs.append(self._output(req, [], True, ""))
        for req, token in zip(sampled_reqs, tokens):
            rid = req.request_id
            text = ""
            stream = self._texts.get(rid)
            # As vLLM v1: the EOS or stop token id that ended a request adds no text, unless
            # include_stop_str_in_output (the token id is still in the output's ids).
            if stream is not None and not (rid in finished and req.status is RequestStatus.FINISHED_STOPPED
                                           and not req.sampling.include_stop_str_in_output):
                text, hit = stream.add(token)
                if hit and rid not in finished:
                    self.scheduler.finish(rid, RequestStatus.FINISHED_STOPPED)
                    finished.add(rid)
            if rid in finished:
                text += self._flush(rid)
            lp = logprobs.get(rid)
            result.outputs.append(self._output(req, [token], rid in finished, text, None if lp is None else [lp]))
        for req, base, lps in drafted:
            self._emit_drafted(req, base, lps, finished, result)
        for rid in finished:
            self._forget(rid)
        if self.proposer is not None:
            self._propose(sampled_reqs, drafted, finished)
        result.duration_s = time.perf_counter() - t0
        if out.spec_tokens:
            return result       # drafts' rows make it no sample of the step-time models below
        if out.prefills:
            self.scheduler.packer.observe(out.prefills, result.duration_s)
        if out.decodes and not out.prefills:
            self.scheduler.decode_selector.observe(len(out.decodes), max(r.num_computed_tokens for r in out.decodes),
                                                   result.duration_s)
        return result

    def _verify_drafts(self, req: Request, drafts: list[int], raw: torch.Tensor
                       ) -> tuple[list[int], list[TokenLogprob] | None]:
        """The tokens a decode that ran `drafts` keeps (`Sampler.verify` over its rows `raw`
        [1 + k, vocab]) and their log-probabilities if asked. Row j is processed as plain decoding
        would process that position: penalties see the output plus drafts[:j], a structured
        output's pattern is in its state after drafts[:j]."""
        sp, logits = req.sampling, raw
        if sp.penalized:
            n, ids = len(drafts) + 1, req.output_token_ids
            logits = self.sampler.penalize(raw, [sp] * n, [req.prompt_token_ids] * n,
                                           [ids + drafts[:j] for j in range(n)], [_min_tokens_ban(req)] * n)
        constraint = constraint_of(sp)
        if constraint is not None:
            logits = self._guided.mask_drafts(logits, req.request_id, constraint, req.output_token_ids, drafts,
                                              raw=None if logits is raw else raw)
        toks = self.sampler.verify(logits, drafts, sp, len(req.output_token_ids))
        if constraint is not None:
            for t in toks:
                self._guided.advance(req.request_id, t)
        lps = None if sp.logprobs is None else self.sampler.logprobs(raw, list(range(len(toks))), toks,
                                                                     [sp.logprobs] * len(toks))
        return toks, lps

    def _emit_drafted(self, req: Request, base: int, lps: list[TokenLogprob] | None, finished: set[str],
                      result: StepResult) -> None:
        """The output of a decode that ran drafts: the tokens `update` appended from position
        `base` (it stops at one that ends the request), cut after the first that completes a
        stop string, as one token at a time would have been."""
        rid = req.request_id
        toks = req.output_token_ids[base:]
        text = ""
        stream = self._texts.get(rid)
        if stream is not None:
            for j, token in enumerate(toks):
                last = j == len(toks) - 1
                if last and rid in finished and req.status is RequestStatus.FINISHED_STOPPED \
                        and not req.sampling.include_stop_str_in_output:
                    break           # the EOS / stop token id adds no text (see step)
                piece, hit = stream.add(token)
                text += piece
                if hit:
                    if rid not in finished:
                        self.scheduler.finish(rid, RequestStatus.FINISHED_STOPPED)
                        finished.add(rid)
                    elif not last:
                        req.status = RequestStatus.FINISHED_STOPPED     # it came before the end
                    del req.output_token_ids[base + j + 1:]
                    toks = toks[:j + 1]
                    break
        if rid in finished:
            text += self._flush(rid)
        result.outputs.append(self._output(req, toks, rid in finished, text,
                                           None if lps is None else lps[:len(toks)]))

    def _propose(self, sampled: list[Request], drafted: list[tuple], finished: set[str]) -> None:
        """Drafts for the next step of every request still decoding that got tokens now."""
        decoding, max_len = self.scheduler.decoding, self.max_model_len
        reqs = [r for r in [*sampled, *(d[0] for d in drafted)]
                if r.request_id not in finished and r.request_id in decoding]
        # Room for the drafts and the token after them, within max_tokens and the context.
        rooms = [min(r.sampling.max_tokens - len(r.output_token_ids), max_len - r.num_tokens) - 1 for r in reqs]
        for req, drafts in zip(reqs, self.proposer.propose_batch(reqs, rooms)):
            req.spec_token_ids = drafts

    def _forget(self, rid: str) -> None:
        if self._guided is not None:
            self._guided.forget(rid)
        if self.proposer is not None:
            self.proposer.forget(rid)
        if self.lora.retiring:
            self.lora.collect({r.sampling.lora_adapter for r in self.scheduler.requests.values()
                               if r.request_id != rid})

    # ---- LoRA adapters at run time (vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter) -----
    def read_lora(self, name: str, path: str) -> LoRAAdapter:
        """Read and check the adapter at `path` (AdapterError naming the problem). Touches no
        engine state: callers run it off the step thread, then hand the result to `lora.add`."""
        return load_adapter(path, self.model.config, name, _DTYPES[self.config.dtype])

    def unload_lora(self, name: str) -> None:
        """New requests may no longer use `name` (AdapterNotFound if it is not served); its
        weights go once no request runs on it (at once if none does)."""
        self.lora.retire(name)
        self.lora.collect({r.sampling.lora_adapter for r in self.scheduler.requests.values()})

    def _record_prompt_logprobs(self, req: Request, first: int, logits) -> None:
        """Row i of `logits` holds position first + i's prediction of prompt token first + i + 1."""
        n = logits.shape[0]
        targets = req.prompt_token_ids[first + 1:first + 1 + n]
        lps = self.sampler.logprobs(logits, list(range(n)), targets, [req.sampling.prompt_logprobs] * n)
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * (req.num_prompt_tokens - 1)
        req.prompt_logprobs[first:first + n] = lps

    def _flush(self, rid: str) -> str:
        stream = self._texts.pop(rid, None)
        return stream.flush() if stream is not None else ""

    def _output(self, req: Request, tokens: list[int], finished: bool, text: str = "",
                logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        reason = req.status.value if finished else None
        prompt_lps = None
        if req.sampling.prompt_logprobs is not None and tokens and len(req.output_token_ids) == 1:
            prompt_lps = [None, *(req.prompt_logprobs or ())]     # with the first token, once
        first = tokens and len(req.output_token_ids) == len(tokens) and req.first_scheduled_time is not None
        return RequestOutput(req.request_id, tokens, text, finished, reason,
                             req.num_prompt_tokens, len(req.output_token_ids), logprobs, req.num_cached_tokens,
                             prompt_lps, req.first_token_time - req.first_scheduled_time if first else None,
                             req.embedding if finished else None)

    # ---- convenience -----------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams],
                 max_steps: int = 1_000_000) -> list[list[int]]:
        """Run prompts to completion; returns each request's output token ids in input order."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        reqs = [self.add_request(f"gen-{id(self)}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        for _ in range(max_steps):
            if not self.has_unfinished():
                break
            self.step()
        else:
            raise RuntimeError(f"generate did not finish within {max_steps} steps")
        return [list(r.output_token_ids) for r in reqs]
