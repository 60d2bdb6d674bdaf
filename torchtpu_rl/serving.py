"""A request-level rollout engine: continuous batching over a paged KV cache with prefix sharing.

:class:`ServingEngine` has :class:`~torchtpu_rl.rollout.RolloutEngine`'s surface (``generate``,
``update_weights``, ``load_state_dict``, ``pause``/``resume``, ``policy_version``,
``last_stats``), so a rollout worker can drive either, plus a streaming one (``submit``,
``step``, ``stream``, ``abort``). How it works:

- **Requests and slots.** A request is prompt token ids, :class:`SamplingParams`, ``n`` samples,
  an id and a seed; each sample is a sequence. At most ``max_slots`` sequences run at once. Every
  engine step (1) admits waiting sequences into free slots and prefills them, up to
  ``prefill_tokens_per_step`` prompt tokens (a longer prompt is prefilled in chunks over several
  steps, decoding going on in between), and (2) decodes one token for every running sequence. A
  sequence that stops frees its slot and pages at once; the next step's admission refills it. The
  decode batch is the running rows padded to a ``slot_buckets`` size, so when the queue drains the
  tail is decoded at a smaller width.
- **Paged KV** (:mod:`torchtpu_rl.kv_pages`): ``kv_pages`` pages of ``page_size`` tokens (or
  ``kv_bytes`` worth); a sequence holds the pages it has filled. When a running sequence needs a
  page and none is free (after evicting unused prefix-cache pages), the most recently admitted
  sequence is preempted: its pages are released and it is requeued at the front with the tokens
  it has, to be recomputed (one prefill) when pages free up. A request that could never fit the
  budget alone is refused at submit.
- **Prefix sharing.** Sequences of one prompt admitted together (the samples of a request, or
  requests of the same prompt) prefill it once: they share its full pages (reference counts) and
  copy its last partial page (copy-on-write). Full token blocks of prefilled, finished and
  preempted sequences go to an LRU prefix cache, with a copy of each prompt's last block, so a
  prompt seen before (a group's later samples when slots are short, a conversation's next turn)
  prefills only what is new (one token for a whole prompt seen before).
- **Sampling** is per row (each request its own temperature/top-k/top-p) and its Gumbel noise is a
  counter-based hash of (request seed, request id, sample index, position) computed on the
  device: a request's tokens do not depend on which requests shared its batch, or on preemption.
- **Shapes.** Every device program is one of (rows bucket, pages bucket) for decode and (rows
  bucket, tokens bucket, pages bucket) for prefill; the step's tokens, positions, slots, block
  tables and sampling values are sent as two tensors, never baked into a program, and the read
  index and masks are built inside it. With ``compile=True`` (default on tpu) a decode step
  (forward and sampling) is one ``torch.compile(backend="tpu")`` program per shape.
- **Weight updates in flight** (:meth:`ServingEngine.update_weights`): ``mode="finish"`` lets
  running sequences finish first (waiting ones start under the new weights), ``"abort"`` requeues
  every in-flight sequence from its prompt, ``"continue"`` keeps them going under the new weights.
  Every token records the policy version that sampled it (``RolloutBatch.token_versions``).

Hugging Face causal LMs whose layers :func:`~torchtpu_rl.hf_cache.kv_cache_support` accepts
(full and sliding-window attention: Llama, Qwen2/3, Mistral, Gemma2, Phi3) run here; the masks
(causal, per-row lengths, sliding windows) are built by the engine and passed to the model ready
made.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import operator
import threading
import time
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

import torchtpu
from torchtpu import bucketing
from torchtpu.bucketing import BucketPolicy

from .kv_pages import SCRATCH_PAGE, PageAllocator, PagedCache, PrefixCache, _kv_shape, copy_slots, kv_bytes_per_token
from .policy import is_hf_model
from .rollout import PauseGate, RolloutBatch, RolloutEngine, SamplingParams, rollout_model

__all__ = ["RequestOutput", "SampleOutput", "ServingEngine", "UPDATE_MODES", "sample_rows"]

UPDATE_MODES = ("finish", "abort", "continue")
_M32 = 0xFFFFFFFF
_RECOMPILE_LIMIT = 512  # slots x pages (x tokens) buckets x filtered: a few dozen programs in practice


# ================================================================= per-row sampling
def _mix32(h):
    # a 32-bit integer hash (xorshift-multiply rounds); multipliers < 2**31 keep every product < 2**63
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x2C1B3C6D) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x297A2D39) & _M32
    return h ^ (h >> 15)


def stream_uniform(key, pos, vocab: int):
    """Uniforms (B, vocab) in (0, 1): a pure function of each row's stream ``key`` (B,) and
    ``pos`` (B,) (int64 in [0, 2**32)), so a row's draws never depend on the rest of the batch."""
    row = _mix32(key ^ _mix32((pos + 0x165667B1) & _M32))
    v = torch.arange(vocab, device=key.device, dtype=torch.int64)
    h = _mix32((row[:, None] ^ ((v * 0x5BD1E995) & _M32)[None, :]))
    return ((h >> 8).float() + 0.5) * (1.0 / (1 << 24))


def sample_rows(logits, temperature, greedy, top_k, top_p, key, pos, filtered: bool):
    """One token per row of ``logits`` (B, V) with per-row sampling values: ``(tokens, logprobs)``.

    :func:`~torchtpu_rl.rollout.sample_from_logits`' arithmetic (the log-prob is that of
    ``log_softmax(logits / temperature)`` before truncation; greedy rows: of ``logits``), with
    ``temperature``/``top_k``/``top_p`` (B,) tensors (``top_k`` 0 = off, ``top_p`` > 1 = off) and
    Gumbel noise from :func:`stream_uniform`. ``filtered`` (static): some row uses top-k/top-p.
    """
    logits = logits.float()
    V = logits.shape[-1]
    t = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / t[:, None]
    logp_all = F.log_softmax(scaled, -1)
    filt = scaled
    if filtered:
        neg_inf = float("-inf")
        srt = torch.sort(scaled, dim=-1, descending=True).values
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, V)).clamp(max=V)
        kth = srt.gather(1, (k - 1)[:, None])
        filt = filt.masked_fill(filt < kth, neg_inf)
        srt = srt.masked_fill(srt < kth, neg_inf)
        probs = F.softmax(srt, -1)
        keep = (probs.cumsum(-1) - probs) < top_p[:, None]
        thresh = torch.where(keep, srt, torch.full_like(srt, float("inf"))).amin(-1, keepdim=True)
        filt = filt.masked_fill(filt < thresh, neg_inf)
    u = stream_uniform(key, pos, V)
    drawn = (filt - torch.log(-torch.log(u))).argmax(-1)
    tok = torch.where(greedy, logits.argmax(-1), drawn)
    logp = logp_all.gather(-1, tok[:, None]).squeeze(-1)
    return tok, logp


# Each step's host-built values travel as one int64 tensor (ints) and one float32 tensor (floats) per
# program, one transfer each; the programs slice them (static offsets) and build the read index and
# masks on the device. Row layout of ``ints``: tokens[T] | positions[T] (-1: padding) | write slots[T]
# | block table[pages] | top_k | stream key | draw position | greedy; of ``floats``: temperature | top_p.
_SAMPLING_INTS = 4


def _masks(qpos, S: int, kinds: tuple, window, additive: bool):
    """(B, 1, T, S) masks: the query at position ``qpos[b, t]`` (-1: padding) reads positions
    ``j <= qpos`` (sliding layers: also ``j > qpos - window``); a dict per layer kind when the model
    mixes kinds (the form Hugging Face models take ready-made masks in)."""
    j = torch.arange(S, device=qpos.device)
    q = qpos[:, None, :, None]
    full = (j <= q) | ((q < 0) & (j == 0))  # a padding query reads one scratch slot: its softmax stays finite
    out = {}
    for kind in kinds:
        m = full
        if kind == "sliding_attention" and window:
            m = m & ((j > q - window) | (q < 0))
        if additive:  # eager attention adds its mask
            m = torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill(
                ~m, torch.finfo(torch.float32).min)
        out[kind] = m
    return out[kinds[0]] if len(kinds) == 1 else out


def _sampling_args(ints, floats):
    k, key, pos, greedy = (ints[:, i] for i in range(-_SAMPLING_INTS, 0))
    return floats[:, 0], greedy.bool(), k, floats[:, 1], key, pos


def _forward_logits(model, cache, ints, T: int, pages: int, page_size: int, kinds: tuple, window, additive: bool):
    """Last-position logits (B, V) of a paged forward of the B rows of T tokens packed in ``ints``."""
    ids, qpos, write = ints[:, :T], ints[:, T:2 * T], ints[:, 2 * T:3 * T]
    table = ints[:, 3 * T:3 * T + pages]
    col = torch.arange(pages * page_size, device=ints.device)
    read = table.index_select(1, col // page_size) * page_size + col % page_size
    cache.set_indices(write.reshape(-1), read)
    out = model(input_ids=ids, attention_mask=_masks(qpos, pages * page_size, kinds, window, additive),
                position_ids=qpos.clamp(min=0), past_key_values=cache, use_cache=True, logits_to_keep=1,
                cache_position=torch.arange(T, device=ints.device))
    return out.logits[:, -1]


def _draw(logits, ints, floats, filtered):
    tok, logp = sample_rows(logits, *_sampling_args(ints, floats), filtered)
    return torch.stack([tok.to(torch.float32), logp])  # one transfer back (token ids < 2**24 are exact)


def _decode_program(model, cache, ints, floats, T, pages, page_size, kinds, window, additive, filtered):
    """A decode step: the forward and a draw for every row, one program."""
    logits = _forward_logits(model, cache, ints, T, pages, page_size, kinds, window, additive)
    return _draw(logits, ints, floats, filtered)


def _sample_program(logits, ints, floats, filtered):
    """A prefill's draws: rows ``ints[:, 0]`` of ``logits``, several per prompt."""
    return _draw(logits.index_select(0, ints[:, 0]), ints, floats, filtered)


def _slot_buckets(max_slots: int) -> BucketPolicy:
    """Powers of two and their halfway points (1, 2, 3, 4, 6, 8, 12, ...) up to ``max_slots``: a draining
    batch pads at most a third, on about twice the programs of powers of two alone."""
    sizes = {max_slots}
    b = 1
    while b < max_slots:
        sizes.update({b, b + b // 2})
        b *= 2
    return BucketPolicy.explicit(sorted(x for x in sizes if x <= max_slots), name="slots")


# ================================================================= requests and outputs
@dataclasses.dataclass
class SampleOutput:
    """One sample of a request: response tokens (a stop token kept), their log-probs and the policy
    version that sampled each; ``finish_reason`` "stop" or "length"."""

    tokens: list
    logprobs: list
    versions: list
    finish_reason: str

    @property
    def stopped(self) -> bool:
        return self.finish_reason == "stop"


@dataclasses.dataclass
class RequestOutput:
    """A finished request: its id, prompt and ``n`` :class:`SampleOutput`."""

    request_id: str
    prompt: list
    samples: list
    temperature: float
    pad_id: int = 0

    def to_batch(self) -> RolloutBatch:
        return _to_batch([(self.prompt, s) for s in self.samples], self.pad_id, self.temperature)


def _to_batch(rows, pad_id, temperature) -> RolloutBatch:
    n = len(rows)
    P = max(len(p) for p, _ in rows)
    R = max(1, max(len(s.tokens) for _, s in rows))
    p_ids = torch.full((n, P), pad_id, dtype=torch.int64)
    p_mask = torch.zeros((n, P), dtype=torch.int64)
    resp = torch.full((n, R), pad_id, dtype=torch.int64)
    valid = torch.zeros((n, R), dtype=torch.bool)
    logp = torch.zeros((n, R), dtype=torch.float32)
    vers = torch.zeros((n, R), dtype=torch.int64)
    first = torch.zeros(n, dtype=torch.int64)
    stopped = torch.zeros(n, dtype=torch.bool)
    for i, (p, s) in enumerate(rows):
        p_ids[i, P - len(p):] = torch.tensor(p, dtype=torch.int64)
        p_mask[i, P - len(p):] = 1
        L = len(s.tokens)
        if L:
            resp[i, :L] = torch.tensor(s.tokens, dtype=torch.int64)
            logp[i, :L] = torch.tensor(s.logprobs, dtype=torch.float32)
            vers[i, :L] = torch.tensor(s.versions, dtype=torch.int64)
            vers[i, L:] = s.versions[-1]
            first[i] = min(s.versions)
        valid[i, :L] = True
        stopped[i] = s.stopped
    return RolloutBatch(prompt_ids=p_ids, prompt_mask=p_mask, response_ids=resp, response_mask=valid, logprobs=logp,
                        policy_version=first, stopped=stopped, pad_id=pad_id, temperature=temperature,
                        token_versions=vers)


class _Request:
    def __init__(self, rid, prompt, params, n, seed, order):
        self.id, self.prompt, self.params, self.n, self.seed = rid, prompt, params, n, seed
        self.order = order
        self.seqs: list = []
        self.live = n


class _Seq:
    __slots__ = ("req", "index", "tokens", "logprobs", "versions", "pages", "computed", "key", "order", "state",
                 "finish")

    def __init__(self, req, index, order):
        self.req, self.index, self.order = req, index, order
        self.tokens = list(req.prompt)
        self.logprobs, self.versions = [], []
        self.pages: list = []
        self.computed = 0  # tokens whose keys/values are in pages
        h = hashlib.blake2b(f"{req.seed}\x00{req.id}\x00{index}".encode(), digest_size=4).digest()
        self.key = int.from_bytes(h, "little")
        self.state = "waiting"
        self.finish = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.req.prompt)


class _PendingUpdate:
    def __init__(self, state_dict, version, mode):
        self.state_dict, self.version, self.mode = state_dict, version, mode
        self.done = threading.Event()
        self.result = None
        self.error = None


# ================================================================= the engine
class ServingEngine(PauseGate):
    """Continuous-batching generation for a Hugging Face causal LM on ``device``.

    ``max_slots``: sequences decoded at once. ``page_size``: tokens per KV page. The KV budget is
    ``kv_pages`` pages, or ``kv_bytes`` (bytes of keys and values over all layers), default enough
    for ``max_slots`` sequences of the model's full context. ``prefill_tokens_per_step``: prompt
    tokens computed per step (chunks of longer prompts continue next step). ``slot_buckets``,
    ``token_buckets``, ``page_buckets`` (:class:`BucketPolicy`): the row, prefill-token and
    pages-per-row sizes programs are built for (defaults: powers of two). ``seed``: the default
    request seed. ``compile``: one ``torch.compile(backend="tpu")`` program per step shape
    (default: on for tpu). ``prefix_cache``: keep full token blocks for reuse.
    """

    def __init__(self, model: nn.Module, pad_id: int, max_slots: int = 64, page_size: int = 16,
                 kv_pages: Optional[int] = None, kv_bytes: Optional[int] = None,
                 prefill_tokens_per_step: int = 2048, slot_buckets: Optional[BucketPolicy] = None,
                 token_buckets: Optional[BucketPolicy] = None, page_buckets: Optional[BucketPolicy] = None,
                 device="tpu", compile: Optional[bool] = None, seed: int = 0, policy_version: int = 0,
                 prefix_cache: bool = True, quantization: Optional[str] = None, lora=None,
                 dtype: Optional[torch.dtype] = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"ServingEngine: model must be an nn.Module, not {type(model).__name__}")
        if not is_hf_model(model):
            raise TypeError(f"ServingEngine: {type(model).__name__} is not a Hugging Face causal LM (the paged "
                            "cache plugs into transformers' attention); use RolloutEngine")
        from .hf_cache import kv_cache_support, use_grouped_attention

        ok, why = kv_cache_support(model)
        if not ok:
            raise ValueError(f"ServingEngine: {model.config.model_type} cannot decode with a paged KV cache: {why}")
        for name, v in (("max_slots", max_slots), ("page_size", page_size),
                        ("prefill_tokens_per_step", prefill_tokens_per_step)):
            if operator.index(v) < 1:
                raise ValueError(f"ServingEngine: {name} must be >= 1, not {v}")
        if kv_pages is not None and kv_bytes is not None:
            raise ValueError("ServingEngine: pass kv_pages or kv_bytes, not both")
        self.device = torch.device(device)
        # LoRA, rollout dtype and quantization as RolloutEngine has them (see its docstring)
        self.model, self.lora, self._reference, self.quantized_layers = rollout_model(
            "ServingEngine", model, self.device, lora, dtype, quantization)
        self.quantization = quantization
        use_grouped_attention(self.model)
        self.pad_id = operator.index(pad_id)
        cfg = model.config.get_text_config(decoder=True)
        self.vocab_size = cfg.vocab_size
        self.max_seq_len = getattr(cfg, "max_position_embeddings", None) or 2048
        self.sliding_window = getattr(cfg, "sliding_window", None)
        self.max_slots, self.page_size = int(max_slots), int(page_size)
        self.prefill_tokens_per_step = int(prefill_tokens_per_step)
        self.token_bytes = kv_bytes_per_token(self.model)
        if kv_bytes is not None:
            kv_pages = int(kv_bytes) // (self.token_bytes * self.page_size)
            if kv_pages < 1:
                raise ValueError(f"ServingEngine: kv_bytes={kv_bytes} holds no page of {self.page_size} tokens "
                                 f"({self.token_bytes * self.page_size} bytes)")
        if kv_pages is None:
            kv_pages = self.max_slots * math.ceil(self.max_seq_len / self.page_size)
        if operator.index(kv_pages) < 1:
            raise ValueError(f"ServingEngine: kv_pages must be >= 1, not {kv_pages}")
        self.kv_pages = int(kv_pages)
        self.max_pages_per_seq = math.ceil(self.max_seq_len / self.page_size)
        self.slot_buckets = slot_buckets or _slot_buckets(self.max_slots)
        self.token_buckets = token_buckets or BucketPolicy.pow2(
            min(16, self.prefill_tokens_per_step), self.prefill_tokens_per_step, name="prefill_tokens")
        self.page_buckets = page_buckets or BucketPolicy.pow2(1, max(1, self.max_pages_per_seq), name="pages")
        self.copy_buckets = BucketPolicy.pow2(1, 2 * self.max_slots, name="pages_copied")
        for name, p in (("slot_buckets", self.slot_buckets), ("token_buckets", self.token_buckets),
                        ("page_buckets", self.page_buckets)):
            if not isinstance(p, BucketPolicy):
                raise TypeError(f"ServingEngine: {name} must be a torchtpu.bucketing.BucketPolicy")
        if self.slot_buckets.largest < self.max_slots:
            raise ValueError(f"ServingEngine: slot_buckets' largest bucket {self.slot_buckets.largest} is below "
                             f"max_slots {self.max_slots}")
        self.layer_types = _kv_shape(self.model)[0]
        self._eager_mask = getattr(self.model.config, "_attn_implementation", None) == "eager"
        self.compile = (self.device.type == "tpu") if compile is None else bool(compile)
        self.seed = int(seed)
        self.policy_version = int(policy_version)
        self.use_prefix_cache = bool(prefix_cache)
        self.cache = PagedCache(self.model, self.kv_pages, self.page_size, device=self.device)
        self.pages = PageAllocator(self.kv_pages, self.page_size)
        self.prefix = PrefixCache(self.pages)
        self._requests: dict = {}
        self._waiting: list = []  # sequences, admission order
        self._running: list = []
        self._finished: list = []  # RequestOutput not yet handed out by stream()
        self._ids = itertools.count()
        self._order = itertools.count()
        self._lock = threading.RLock()
        self._paused_by = None
        self._pending: Optional[_PendingUpdate] = None
        self._draining: Optional[_PendingUpdate] = None
        self._compiled: dict = {}
        self._generating = False
        self._counters()
        self.last_stats: dict = {}

    def _counters(self):
        self._c = dict(useful_tokens=0, decode_useful=0, tail_hit_tokens=0, decode_rows=0, decode_steps=0,
                       prefill_tokens=0, preemptions=0, forked=0)
        self._hit0 = self.prefix.hit_tokens
        self.pages.reset_peak()
        self._t0 = time.perf_counter()
        self._compiles0 = torchtpu.metrics.snapshot()["compiles"]

    # ------------------------------------------------------------ requests
    def submit(self, prompt, params: Optional[SamplingParams] = None, n: int = 1, request_id=None,
               seed: Optional[int] = None) -> str:
        """Queue a request of ``n`` samples of ``prompt`` (token ids); returns its id (``request_id``,
        default a fresh one). ``seed`` (default the engine's) keys its sampling stream."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"ServingEngine.submit: params must be SamplingParams, not {type(params).__name__}")
        rid = f"req-{next(self._ids)}" if request_id is None else str(request_id)
        if rid in self._requests:
            raise ValueError(f"ServingEngine.submit: request id {rid!r} is already in flight")
        if operator.index(n) < 1:
            raise ValueError(f"ServingEngine.submit: request {rid!r}: n must be >= 1, not {n}")
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.tolist()
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError(f"ServingEngine.submit: request {rid!r}: the prompt must be a non-empty list of token ids")
        try:
            prompt = [operator.index(x) for x in prompt]
        except TypeError:
            raise TypeError(f"ServingEngine.submit: request {rid!r}: the prompt must hold ints") from None
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise ValueError(f"ServingEngine.submit: request {rid!r} has token ids outside [0, {self.vocab_size})")
        bad = [s for s in params.stop_token_ids if s >= self.vocab_size]
        if bad:
            raise ValueError(f"ServingEngine.submit: request {rid!r}: SamplingParams.stop_token_ids {bad} are "
                             f"outside the vocabulary ({self.vocab_size})")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_seq_len:
            raise ValueError(f"ServingEngine.submit: request {rid!r}: a prompt of {len(prompt)} tokens + "
                             f"max_new_tokens {params.max_new_tokens} exceed the model's context {self.max_seq_len}")
        need = math.ceil(total / self.page_size)
        if need > self.kv_pages:
            raise ValueError(f"ServingEngine.submit: request {rid!r} needs {need} KV pages ({total} tokens of "
                             f"{self.page_size}), more than the whole budget of {self.kv_pages} pages")
        with self._lock:
            if rid in self._requests:
                raise ValueError(f"ServingEngine.submit: request id {rid!r} is already in flight")
            if not self._requests and not self._generating:
                self._counters()  # an idle engine starts a new stream: last_stats covers it
            req = _Request(rid, prompt, params, int(n), self.seed if seed is None else int(seed), next(self._order))
            req.seqs = [_Seq(req, i, req.order) for i in range(req.n)]
            self._requests[rid] = req
            self._waiting.extend(req.seqs)
        return rid

    def abort(self, request_ids) -> None:
        """Drop requests (an id or a list of ids) wherever they are: their pages are freed and they are
        never returned. An unknown id is a KeyError (nothing is aborted then)."""
        ids = [request_ids] if isinstance(request_ids, str) else [str(r) for r in request_ids]
        with self._lock:
            unknown = [r for r in ids if r not in self._requests]
            if unknown:
                raise KeyError(f"ServingEngine.abort: no request in flight with id {unknown[0]!r}")
            for r in ids:
                req = self._requests.pop(r)
                for s in req.seqs:
                    self._release(s)
                self._waiting = [s for s in self._waiting if s.req is not req]
                self._running = [s for s in self._running if s.req is not req]

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def stream(self) -> Iterator[RequestOutput]:
        """Step until every submitted request is finished, yielding each as it finishes;
        ``last_stats`` then covers the requests since the engine was last idle."""
        while True:
            with self._lock, torch.no_grad():
                if not self._finished and self._requests:
                    self._step()
                out, self._finished = self._finished, []
                if not out and not self._requests:
                    self._record_stats()
                    return
            yield from out

    def step(self) -> list:
        """One engine step; returns the requests finished by it (and any not yet handed out)."""
        with self._lock:
            if self._requests:
                self._step()
            out, self._finished = self._finished, []
        return out

    # ------------------------------------------------------------ generate (RolloutEngine's surface)
    def generate(self, prompts, params: Optional[SamplingParams] = None,
                 policy_version: Optional[int] = None) -> RolloutBatch:
        """A response for every prompt, in order, as a host :class:`RolloutBatch`. Equal prompts become
        one request of ``n`` samples (their prompt prefilled once). ``policy_version`` tags the
        output (default: the version of the weights that sampled each token)."""
        params = params or SamplingParams()
        if isinstance(prompts, torch.Tensor) and prompts.dim() == 2:
            prompts = list(prompts)
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("ServingEngine.generate: prompts must be a non-empty list of token-id lists")
        if self._paused_by is not None and self._paused_by == threading.get_ident():
            raise RuntimeError("ServingEngine.generate called while this thread holds pause(); call resume()")
        if self.memory_released:
            raise RuntimeError("ServingEngine.generate: the KV memory is released (release_memory()); call "
                               "resume_memory() first")
        groups: dict = {}
        for i, p in enumerate(prompts):
            key = tuple(p.tolist() if isinstance(p, torch.Tensor) else p)
            groups.setdefault(key, []).append(i)
        with self._lock, torch.no_grad():
            self._counters()
            self._generating = True
            ids = {}
            try:
                for key, rows in groups.items():
                    ids[self.submit(list(key), params, n=len(rows))] = rows
            except Exception:
                if ids:
                    self.abort(list(ids))
                raise
            finally:
                self._generating = False
            done = {}
            while len(done) < len(ids):
                for out in self._drive():
                    if out.request_id in ids:
                        done[out.request_id] = out
                    else:
                        self._finished.append(out)
            self._record_stats()
        rows = [None] * len(prompts)
        for rid, out in done.items():
            for i, s in zip(ids[rid], out.samples):
                rows[i] = (out.prompt, s)
        batch = _to_batch(rows, self.pad_id, params.temperature)
        if policy_version is not None:
            batch.policy_version.fill_(int(policy_version))
            batch.token_versions.fill_(int(policy_version))
        return batch

    def _drive(self) -> list:
        self._step()
        out, self._finished = self._finished, []
        return out

    def _record_stats(self):
        c = self._c
        seconds = time.perf_counter() - self._t0
        compiles = torchtpu.metrics.snapshot()["compiles"] - self._compiles0
        self.last_stats = {
            "seconds": seconds, "useful_tokens": c["useful_tokens"], "response_tokens": c["useful_tokens"],
            "decode_rows": c["decode_rows"], "decode_steps": c["decode_steps"],
            # the share of decode rows computed whose token was kept (padding rows and bucket slack count)
            "row_utilization": c["decode_useful"] / c["decode_rows"] if c["decode_rows"] else float("nan"),
            "prefill_tokens": c["prefill_tokens"],
            "prefix_hit_tokens": self.prefix.hit_tokens - self._hit0 + c["tail_hit_tokens"],
            "forked_samples": c["forked"], "kv_pages_peak": self.pages.peak,
            "kv_bytes_peak": self.pages.peak * self.page_size * self.token_bytes,
            "preemptions": c["preemptions"], "compiles": compiles,
            "tokens_per_s": c["useful_tokens"] / seconds if seconds > 0 else float("nan")}

    # ------------------------------------------------------------ scheduling
    def _release(self, s: _Seq, cache_blocks: bool = False) -> None:
        if cache_blocks and self.use_prefix_cache and s.pages:
            self.prefix.insert(s.tokens[:s.computed], s.pages)
        for p in s.pages:
            self.pages.decref(p)
        s.pages, s.computed = [], 0

    def _alloc(self) -> Optional[int]:
        p = self.pages.alloc()
        while p is None and self.prefix.evict_one():
            p = self.pages.alloc()
        return p

    def _grow(self, s: _Seq, tokens: int) -> bool:
        """Give ``s`` pages for its first ``tokens`` positions; False (nothing taken) if they run out."""
        need = math.ceil(tokens / self.page_size) - len(s.pages)
        got = []
        for _ in range(need):
            p = self._alloc()
            if p is None:
                for q in got:
                    self.pages.decref(q)
                return False
            got.append(p)
        s.pages.extend(got)
        return True

    def _make_room(self, s: _Seq, tokens: int) -> bool:
        """Pages for ``s``'s first ``tokens`` positions, preempting the most recently admitted running
        sequences while they run out; False if ``s`` itself was the one preempted."""
        while not self._grow(s, tokens):
            victim = max(self._running, key=lambda q: q.order)
            self._preempt(victim)
            if victim is s:
                return False
        return True

    def _preempt(self, s: _Seq) -> None:
        self._release(s, cache_blocks=True)
        s.state = "waiting"
        self._running.remove(s)
        self._waiting.insert(0, s)
        self._waiting.sort(key=lambda q: q.order)
        self._c["preemptions"] += 1

    def _step(self) -> None:
        if self.memory_released:
            raise RuntimeError("ServingEngine: the KV memory is released (release_memory()); call "
                               "resume_memory() before generating")
        self._service_update()
        progressed = False
        draining = self._draining is not None
        # ---- admission and prefill (chunked under the token budget)
        budget = self.prefill_tokens_per_step
        chunks = []  # (seq, start, end)
        forks = {}  # leader -> [followers]
        copies = []  # (cached page, own page): prompts seen whole before, copied before the prefill
        prefilling = [s for s in self._running if s.computed < len(s.tokens) - 1]
        for s in prefilling:  # prompts whose prefill continues
            if budget <= 0:
                break
            if s.state != "running":
                continue  # preempted below to make room for an older one
            end = min(len(s.tokens), s.computed + budget)
            if not self._make_room(s, end):
                continue
            chunks = [c for c in chunks if c[0].state == "running"]
            chunks.append((s, s.computed, end))
            budget = self.prefill_tokens_per_step - sum(e - b for _, b, e in chunks)
        while self._waiting and budget > 0 and not draining and len(self._running) < self.max_slots:
            s = self._waiting[0]
            leader = None
            if s.generated == 0:
                leader = next((c[0] for c in chunks if c[0].generated == 0 and c[2] == len(c[0].tokens)
                               and c[0].req.prompt == s.req.prompt), None)
            if leader is not None:
                # the same prompt as a sequence prefilled this step (a sample of its request, or another
                # request of that prompt): shares its prompt pages, and copies its last partial page
                # (copy-on-write) once the prefill wrote it
                own = []
                if len(s.tokens) % self.page_size:
                    p = self._alloc()
                    if p is None:
                        break
                    own = [p]
                self._waiting.pop(0)
                s.state, s.pages = "running", own
                self._running.append(s)
                forks.setdefault(leader, []).append(s)
                continue
            if self.use_prefix_cache:
                full = (len(s.tokens) - 1) // self.page_size  # the blocks before the one of the last token
                s.pages = self.prefix.lookup(s.tokens, full)
                s.computed = len(s.pages) * self.page_size
                tail = self.prefix.lookup_tail(s.tokens, full) if len(s.pages) == full else None
                own = self._alloc() if tail is not None else None
                if own is not None:  # the whole prompt was seen: copy its last block, recompute one token
                    copies.append((tail, own))
                    s.pages.append(own)
                    self._c["tail_hit_tokens"] += len(s.tokens) - 1 - s.computed
                    s.computed = len(s.tokens) - 1
            end = min(len(s.tokens), s.computed + budget)
            if not self._grow(s, end):
                self._release(s)
                break
            self._waiting.pop(0)
            s.state = "running"
            self._running.append(s)
            chunks.append((s, s.computed, end))
            budget -= end - s.computed
        if chunks:
            self._copy(copies)
            self._prefill(chunks, forks)
            progressed = True
        # ---- decode every running sequence with its prompt in the cache
        fresh = {id(c[0]) for c in chunks} | {id(f) for fs in forks.values() for f in fs}
        rows = [s for s in self._running if s.computed == len(s.tokens) - 1 and id(s) not in fresh]
        rows.sort(key=lambda q: q.order)
        ready = []
        for s in rows:
            if s.state != "running":
                continue  # preempted while making room for an older one
            if self._make_room(s, len(s.tokens)):
                ready.append(s)
        ready = [s for s in ready if s.state == "running"]
        if ready:
            self._decode(ready)
            progressed = True
        if not progressed and self._requests:
            if draining and not self._running:
                self._service_update()
                return
            raise RuntimeError(
                f"ServingEngine: no progress possible: {len(self._waiting)} waiting, {len(self._running)} running, "
                f"{self.pages.free} of {self.kv_pages} KV pages free")

    # ------------------------------------------------------------ device steps
    def _fn(self, kind):
        fn = {"decode": _decode_program, "prefill": _forward_logits, "sample": _sample_program, "copy": copy_slots}[kind]
        if not self.compile:
            return fn
        c = self._compiled.get(kind)
        if c is None:
            compiled = torch.compile(fn, backend="tpu", dynamic=False)

            def c(*args):
                # one program per (rows, tokens, pages) bucket: more than Dynamo's default of 8 per function
                with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
                    return compiled(*args)

            self._compiled[kind] = c
        return c

    def _copy(self, pairs) -> None:
        """Copy pages (src, dst) in every layer: one program per bucketed page count (an eager copy would
        rewrite every layer's whole pool per page)."""
        while pairs:
            n = self.copy_buckets.bucket(min(len(pairs), self.copy_buckets.largest))
            head, pairs = pairs[:n], pairs[n:]
            slots = self.cache.page_slots([a for a, _ in head], [b for _, b in head], n)
            with bucketing.bucket_scope(pages_copied=n):
                self._fn("copy")(self.cache, slots.to(self.device))

    def _pack(self, seqs, B, tokens, write, pages):
        """``ints``/``floats`` of a step (layout above ``_masks``): ``tokens`` (B, 2T) token ids and positions,
        ``write`` (B, T) slots, the block tables padded to ``pages``, and each row's sampling values."""
        T = write.shape[1]
        table = [s.pages + [SCRATCH_PAGE] * (pages - len(s.pages)) for s in seqs]
        table += [[SCRATCH_PAGE] * pages] * (B - len(seqs))
        samp, floats = self._sampling(seqs, B)
        ints = torch.cat([tokens, write, torch.tensor(table, dtype=torch.int64).reshape(B, pages), samp], 1)
        return ints, floats, any(self._filtered(s) for s in seqs)

    def _sampling(self, seqs, B):
        """(B, 4) int64 top_k | stream key | draw position | greedy, and (B, 2) float32 temperature | top_p
        (padding rows greedy)."""
        ints, floats = [], []
        for s in seqs:
            sp = s.req.params
            ints.append((sp.top_k, s.key, len(s.tokens), int(sp.greedy)))
            floats.append((sp.temperature, sp.top_p if sp.top_p < 1.0 else 2.0))  # > 1: off, whatever the rounding
        ints += [(0, 0, 0, 1)] * (B - len(seqs))
        floats += [(0.0, 2.0)] * (B - len(seqs))
        return torch.tensor(ints, dtype=torch.int64), torch.tensor(floats, dtype=torch.float32)

    @staticmethod
    def _filtered(s) -> bool:
        sp = s.req.params
        return (not sp.greedy) and (sp.top_k > 0 or sp.top_p < 1.0)

    def _static(self):
        return self.page_size, tuple(sorted(set(self.layer_types))), self.sliding_window, self._eager_mask

    def _slots(self, s, positions):
        return [s.pages[p // self.page_size] * self.page_size + p % self.page_size for p in positions]

    def _prefill(self, chunks, forks):
        """One forward of every chunk (rows left-padded so each ends at column T - 1), then draws for the
        rows whose prompt is complete and for their followers (the same logits, their own streams)."""
        n = len(chunks)
        B = self.slot_buckets.bucket(n)
        T = self.token_buckets.bucket(max(e - b for _, b, e in chunks))
        tokens = torch.full((B, 2 * T), -1, dtype=torch.int64)
        tokens[:, :T] = self.pad_id
        write = torch.zeros((B, T), dtype=torch.int64)  # padding writes the scratch page
        for i, (s, b, e) in enumerate(chunks):
            L = e - b
            tokens[i, T - L:T] = torch.tensor(s.tokens[b:e], dtype=torch.int64)
            tokens[i, 2 * T - L:] = torch.arange(b, e)
            write[i, T - L:] = torch.tensor(self._slots(s, range(b, e)), dtype=torch.int64)
            self._c["prefill_tokens"] += L
            s.computed = e
        seqs = [s for s, _, _ in chunks]
        nP = self.page_buckets.bucket(max(len(s.pages) for s in seqs))
        ints, _, _ = self._pack(seqs, B, tokens, write, nP)
        d = self.device
        with bucketing.bucket_scope(slots=B, tokens=T, pages=nP):
            logits = self._fn("prefill")(self.model, self.cache, ints.to(d), T, nP, *self._static())
        draws, rows, copies = [], [], []
        for i, (s, b, e) in enumerate(chunks):
            if e < len(s.tokens):
                continue  # more chunks to come
            draws.append(s)
            rows.append(i)
            followers = forks.get(s, [])
            if followers:
                full = len(s.tokens) // self.page_size
                for f in followers:
                    for p in s.pages[:full]:
                        self.pages.incref(p)
                    f.pages = s.pages[:full] + f.pages  # f.pages: its own copy of the partial page, if any
                    f.computed = len(f.tokens)
                copies += [(s.pages[full], f.pages[full]) for f in followers if len(f.tokens) % self.page_size]
                self._c["forked"] += len(followers)
                draws.extend(followers)
                rows.extend([i] * len(followers))
            if self.use_prefix_cache:
                self.prefix.insert(s.tokens[:s.computed], s.pages)
                if self.prefix.lookup_tail(s.tokens, (len(s.tokens) - 1) // self.page_size) is None:
                    p = self.pages.alloc()  # only a free page: never evict for this
                    if p is not None:
                        copies.append((s.pages[(len(s.tokens) - 1) // self.page_size], p))
                        self.prefix.insert_tail(s.tokens, p)
        self._copy(copies)
        if not draws:
            return
        Bs = self.slot_buckets.bucket(len(draws))
        samp, floats = self._sampling(draws, Bs)
        idx = torch.zeros((Bs, 1), dtype=torch.int64)
        idx[:len(rows), 0] = torch.tensor(rows, dtype=torch.int64)
        ints = torch.cat([idx, samp], 1)
        filtered = any(self._filtered(s) for s in draws)
        with bucketing.bucket_scope(slots=Bs, rows=B):
            out = self._fn("sample")(logits, ints.to(d), floats.to(d), filtered).cpu()
        tok, logp = out[0].long().tolist(), out[1].tolist()
        for i, s in enumerate(draws):
            self._append(s, tok[i], logp[i])

    def _decode(self, seqs):
        """One token for every row: feed each row's last token (position len - 1)."""
        n = len(seqs)
        B = self.slot_buckets.bucket(n)
        tokens = torch.full((B, 2), -1, dtype=torch.int64)
        tokens[:, 0] = self.pad_id
        write = torch.zeros((B, 1), dtype=torch.int64)
        for i, s in enumerate(seqs):
            p = len(s.tokens) - 1
            tokens[i, 0], tokens[i, 1] = s.tokens[p], p
            write[i, 0] = self._slots(s, [p])[0]
            s.computed = len(s.tokens)
        self._c["decode_rows"] += B
        self._c["decode_steps"] += 1
        nP = self.page_buckets.bucket(max(len(s.pages) for s in seqs))
        ints, floats, filtered = self._pack(seqs, B, tokens, write, nP)
        d = self.device
        with bucketing.bucket_scope(slots=B, pages=nP):
            out = self._fn("decode")(self.model, self.cache, ints.to(d), floats.to(d), 1, nP, *self._static(),
                                     filtered).cpu()
        tok, logp = out[0].long().tolist(), out[1].tolist()
        self._c["decode_useful"] += n
        for i, s in enumerate(seqs):
            self._append(s, tok[i], logp[i])

    def _append(self, s: _Seq, tok: int, logp: float) -> None:
        sp = s.req.params
        s.tokens.append(int(tok))
        s.logprobs.append(float(logp))
        s.versions.append(self.policy_version)
        self._c["useful_tokens"] += 1
        if int(tok) in sp.stop_token_ids:
            s.finish = "stop"
        elif s.generated >= sp.max_new_tokens:
            s.finish = "length"
        if s.finish is None:
            return
        s.state = "done"
        self._running.remove(s)
        self._release(s, cache_blocks=True)
        req = s.req
        req.live -= 1
        if req.live == 0 and self._requests.get(req.id) is req:
            del self._requests[req.id]
            P = len(req.prompt)
            self._finished.append(RequestOutput(
                req.id, list(req.prompt),
                [SampleOutput(q.tokens[P:], q.logprobs, q.versions, q.finish) for q in req.seqs],
                req.params.temperature, self.pad_id))

    # ------------------------------------------------------------ colocated mode: memory
    @property
    def memory_released(self) -> bool:
        """True between :meth:`release_memory` and :meth:`resume_memory`."""
        return not self.cache.allocated

    def release_memory(self) -> int:
        """Free the KV page pools on the device while a colocated learner trains (verl's hybrid engine,
        vLLM's sleep): running sequences are preempted (requeued with the tokens they have, to be
        recomputed after :meth:`resume_memory`), the prefix cache is dropped and the pools are let go.
        Steps refuse to run until :meth:`resume_memory`; requests may still be submitted. The model's
        weights stay where they are (colocated, they are the learner's). Returns the bytes freed."""
        with self._lock:
            if self.memory_released:
                raise RuntimeError("ServingEngine.release_memory: the KV memory is already released; call "
                                   "resume_memory() first")
            for s in sorted(self._running, key=lambda q: -q.order):
                self._preempt(s)
            self.prefix.clear()
            if self.pages.used:
                raise RuntimeError(f"ServingEngine.release_memory: {self.pages.used} KV pages are still held")
            return self.cache.release()

    def resume_memory(self) -> None:
        """Allocate the KV page pools again (zeroed; the same shapes, so no program is rebuilt) after
        :meth:`release_memory`; waiting and preempted sequences continue at the next step."""
        with self._lock:
            if not self.memory_released:
                raise RuntimeError("ServingEngine.resume_memory: the KV memory is not released")
            self.cache.allocate()

    # ------------------------------------------------------------ weights
    def drop_cache(self) -> None:
        """Forget the prefix cache (its pages go back to the pool)."""
        with self._lock:
            self.prefix.clear()

    def sync_reference(self) -> dict:
        """Name -> tensor (dtype, shape) of what a weight update must hold: the model's state dict (in the
        learner's dtype when the rollout's differs), or with ``lora`` the adapter tensors."""
        if self.lora is not None:
            return self.lora.reference()
        return self._reference if self._reference is not None else self.model.state_dict()

    def _check_update(self, state_dict) -> None:
        if self.lora is not None:
            unknown = self.lora.unknown(state_dict)
            if unknown is not None:
                raise ValueError(f"ServingEngine: the update's {unknown!r} is not an adapter tensor of this "
                                 f"engine's LoRA targets")
            return
        ref = self.sync_reference()
        for name, t in state_dict.items():
            if name not in ref:
                raise KeyError(f"ServingEngine: the update's {name!r} is not a parameter or buffer of the model")
            if tuple(t.shape) != tuple(ref[name].shape):
                raise ValueError(f"ServingEngine: the update's {name!r} is {list(t.shape)}, the model's is "
                                 f"{list(ref[name].shape)}")
        missing = [k for k in ref if k not in state_dict]
        if missing:
            raise KeyError(f"ServingEngine: the update lacks {missing[:5]} of the model")

    def load_state_dict(self, state_dict, strict: bool = True) -> dict:
        """Install weights in place (:func:`~torchtpu_rl.weight_sync.install_state_dict`), after checking
        every name and shape; the prefix cache (keys/values of the old weights) is dropped."""
        from .weight_sync import install_state_dict

        if strict or self.lora is not None:
            self._check_update(state_dict)
        with torch.no_grad():
            if self.lora is not None:
                state_dict, strict = self.lora.merged_weights(state_dict), False
            if self.quantized_layers:
                out = self._load_and_requantize(state_dict, strict)
            else:
                out = install_state_dict(self.model, state_dict, strict=strict)
        self.prefix.clear()
        return out

    # the full-precision weights of the quantized layers quantized again: RolloutEngine's one path
    _load_and_requantize = RolloutEngine._load_and_requantize

    def update_weights(self, state_dict, policy_version: Optional[int] = None, mode: str = "finish") -> dict:
        """Install new weights while requests may be in flight. ``mode``: ``"finish"`` (running sequences
        finish under the old weights first), ``"abort"`` (in-flight sequences restart from their prompts
        under the new ones), ``"continue"`` (they go on under the new weights; each token records its
        version). Names and shapes are checked before anything in flight is touched. Safe to call from
        another thread while ``generate`` runs: the stepping thread applies it between steps."""
        if mode not in UPDATE_MODES:
            raise ValueError(f"ServingEngine.update_weights: mode must be one of {UPDATE_MODES}, not {mode!r}")
        self._check_update(state_dict)
        upd = _PendingUpdate(state_dict, policy_version, mode)
        with self._lock:  # re-entrant: a pause()d thread or a stepping thread gets it at once
            if self._pending is not None or self._draining is not None:
                raise RuntimeError("ServingEngine.update_weights: another update is in progress")
            self._pending = upd
        while not upd.done.wait(0.005):
            if self._lock.acquire(blocking=False):
                try:  # nobody is stepping: drive the update ourselves
                    while not upd.done.is_set():
                        self._service_update()
                        if not upd.done.is_set():
                            self._drive_quietly()
                finally:
                    self._lock.release()
        if upd.error is not None:
            raise upd.error
        return upd.result

    def _drive_quietly(self):
        with torch.no_grad():
            self._step()

    def _service_update(self) -> None:
        """At a step boundary: take a pending update per its mode."""
        upd = self._pending
        if upd is not None:
            self._pending = None
            if upd.mode == "finish":
                self._draining = upd
            else:
                if upd.mode == "abort":  # running and preempted sequences restart from their prompts
                    for s in self._running + [q for q in self._waiting if q.generated]:
                        self._c["useful_tokens"] -= s.generated  # recomputed under the new weights
                        self._release(s)
                        del s.tokens[len(s.req.prompt):]
                        s.logprobs.clear()
                        s.versions.clear()
                        s.state = "waiting"
                    self._waiting = sorted(self._running + self._waiting, key=lambda q: q.order)
                    self._running = []
                self._apply(upd)
        upd = self._draining
        if upd is not None and not self._running:
            self._draining = None
            self._apply(upd)

    def _apply(self, upd: _PendingUpdate) -> None:
        try:
            upd.result = self.load_state_dict(upd.state_dict)
            if upd.version is not None:
                self.policy_version = int(upd.version)
            else:
                self.policy_version += 1
        except Exception as e:  # noqa: BLE001 - handed to the caller's thread
            upd.error = e
        upd.done.set()
