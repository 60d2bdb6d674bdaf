"""Hugging Face ``model.generate`` on tpu without a compile per token.

Hugging Face's decoding loop grows ``input_ids`` and ``attention_mask`` by one column per step
(``torch.cat``) and checks the stopping criteria on the grown tensors, so on tpu every step meets
new shapes: each op compiles again for every sequence length, and a DynamicCache grows the keys
and values the same way. For a decoder-only model on tpu, :func:`install` (done by ``import
torchtpu`` once ``transformers`` is imported) serves greedy and sampling ``generate`` with fixed
shapes instead:

- the prompt is left-padded to a power-of-two bucket (pad tokens, attention mask 0) and a
  ``StaticCache`` of a bucketed length ``L >= padded prompt + max_new_tokens`` holds the keys
  and values, whichever cache the user asked for (a DynamicCache's output is the same tokens);
- the padded prompt, the sequences' ``[batch, L]`` buffer, the attention mask and the position ids
  are built on the host from the prompt (small copies, no device program per prompt length);
- every decode step runs the same two programs: the compiled forward (``torch.compile`` with the
  ``"tpu"`` backend, as transformers does for a static cache) returning the last position's float32
  logits, and one JAX program choosing the token (argmax, or a draw from the softmax with the
  global tpu stream's key), writing it into the buffer at a device-side step index and advancing the
  position ids and the end-of-sequence bookkeeping; the logits processors run between the two;
- Hugging Face's own set-up before its loop (a dozen small ops at the prompt's shape) runs under
  DeferAndFuse, so it is a few fused programs, not one per op;
- the attention mask is built once at length ``L``: the prompt's mask (zeros at the left
  padding), then ones. Hugging Face appends a one per generated token, and a column past the
  current position is hidden by the causal mask anyway, so every step attends to exactly the
  keys it attends to in Hugging Face's loop;
- position ids are Hugging Face's (``cumsum(mask) - 1``, then one more per step), so the extra
  left padding moves no real token's rotary position;
- logits processors and stopping criteria see ``input_ids`` as a view of the buffer
  (``buf[:, start:cur]``, metadata only), of the same shape and values as Hugging Face's;
  the end-of-sequence criterion is evaluated on the new token, as ``EosTokenCriteria`` does;
- "all sequences finished" is read on the host every ``SYNC_EVERY`` steps; the steps that
  finished sequences keep taking are counted on the device, so the output is cut at exactly the
  step where Hugging Face's loop stops.

A first call compiles 6 programs (Hugging Face's set-up: 3, the prefill and decode forwards, the
token choice); a new prompt length in a known bucket compiles Hugging Face's set-up only (3); after
that a call compiles nothing. What the fast path
does not cover runs Hugging Face's own loop unchanged: encoder-decoder models, streamers,
``return_dict_in_generate``, a cache passed in by the user, stopping criteria other than
max-length and end-of-sequence, ``prefill_chunk_size``, ``inputs_embeds``, models without
static-cache support, and any call not on tpu. ``TORCHTPU_HF_GENERATE=0`` turns it off.
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch

from .base import rng
from .bucketing import BucketPolicy
from .runtime.modes import deferring, execution_mode

SYNC_EVERY = 4  # decode steps between host reads of "every sequence finished"
LENGTHS = BucketPolicy.pow2(16, 1 << 20, name="hf_generate")  # padded prompt and cache lengths

_state = {"installed": False, "fast_calls": 0, "hf_calls": 0, "last_reason": None}


def enabled() -> bool:
    return os.environ.get("TORCHTPU_HF_GENERATE", "1").strip().lower() not in ("0", "off", "false", "no")


def stats() -> dict:
    """Calls served by the fixed-shape loop (``fast_calls``), by Hugging Face's loop on tpu
    (``hf_calls``), and why the last one was not served (``last_reason``)."""
    return dict(_state)


def install() -> None:
    """Route tpu calls of ``GenerationMixin._sample`` (greedy and sampling ``generate``) through the
    fixed-shape loop. Idempotent; imports transformers, so call it once transformers is imported."""
    if _state["installed"]:
        return
    from transformers.generation.utils import GenerationMixin

    original = GenerationMixin._sample

    @functools.wraps(original)
    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        if input_ids.device.type == "tpu":
            reason = _unsupported(self, stopping_criteria, generation_config, synced_gpus, streamer, model_kwargs)
            _state["last_reason"] = reason
            if reason is None:
                _state["fast_calls"] += 1
                return _fixed_shape_sample(self, input_ids, logits_processor, stopping_criteria, generation_config,
                                           model_kwargs)
            _state["hf_calls"] += 1
        return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                        synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)

    original_generate = GenerationMixin.generate

    @functools.wraps(original_generate)
    def generate(self, *args, **kwargs):
        # Hugging Face's set-up before the loop (special tokens, position ids, processor checks) is a
        # dozen small ops at the prompt's shape: fused into a few programs instead of one per op
        if enabled() and not deferring() and _device_type(self) == "tpu":
            with execution_mode("defer_and_fuse"):
                return original_generate(self, *args, **kwargs)
        return original_generate(self, *args, **kwargs)

    GenerationMixin._sample = _sample
    GenerationMixin.generate = generate
    _state["installed"] = True


def _device_type(model):
    try:
        return next(model.parameters()).device.type
    except (StopIteration, AttributeError):
        return None


def install_when_imported() -> None:
    """:func:`install` now if transformers' generation module is loaded, else right after it is."""
    if "transformers.generation.utils" in sys.modules:
        install()
        return
    import importlib.abc
    import importlib.util

    class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname != "transformers.generation.utils":
                return None
            sys.meta_path.remove(self)  # once: the real finders find the module
            spec = importlib.util.find_spec(fullname)
            if spec is None or spec.loader is None:
                return None
            self.loader, spec.loader = spec.loader, self
            return spec

        def create_module(self, spec):
            return self.loader.create_module(spec)

        def exec_module(self, module):
            self.loader.exec_module(module)
            if enabled():
                install()

    sys.meta_path.insert(0, _AfterImport())


def _unsupported(model, stopping_criteria, cfg, synced_gpus, streamer, model_kwargs):
    """Why this call must run Hugging Face's own loop (None: the fixed-shape loop serves it)."""
    from transformers.cache_utils import Cache
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    if not enabled():
        return "TORCHTPU_HF_GENERATE=0"
    if model.config.is_encoder_decoder:
        return "encoder-decoder model"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"{type(model).__name__} has no static-cache support"
    if synced_gpus or streamer is not None:
        return "synced_gpus or a streamer"
    if cfg.return_dict_in_generate:
        return "return_dict_in_generate"
    if getattr(cfg, "prefill_chunk_size", None) is not None:
        return "prefill_chunk_size"
    if getattr(cfg, "is_assistant", False):
        return "assisted generation"
    if model_kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds"
    cache = model_kwargs.get("past_key_values")
    if cache is not None and (not isinstance(cache, Cache) or getattr(cache, "_is_user_defined", False)
                              or cache.get_seq_length() != 0):
        return "a cache passed in by the caller"
    extra = set(model_kwargs) - {"attention_mask", "position_ids", "past_key_values", "use_cache",
                                 "logits_to_keep", "output_attentions", "output_hidden_states"}
    if extra:
        return f"model kwargs {sorted(extra)}"
    if model_kwargs.get("use_cache") is False:
        return "use_cache=False"
    kinds = {type(c) for c in stopping_criteria}
    if not kinds <= {MaxLengthCriteria, EosTokenCriteria} or MaxLengthCriteria not in kinds:
        return f"stopping criteria {sorted(k.__name__ for k in kinds)}"
    return None


def _programs(model):
    """The compiled forward of ``model``'s fixed-shape loop (``torch.compile``, backend ``"tpu"``,
    static shapes), made once per model: the model's call, returning the last position's float32
    logits. The prefill's and the decode's shapes are separate specializations, so neither evicts
    the other; each compiles once per (batch, bucket) shape."""
    fn = model.__dict__.get("_torchtpu_generate_logits")
    if fn is None:
        def logits(**kw):
            return model(**kw).logits[:, -1].to(dtype=torch.float32)

        fn = torch.compile(logits, backend="tpu", dynamic=False)
        model.__dict__["_torchtpu_generate_logits"] = fn
    return fn


@functools.partial(jax.jit, static_argnames=("shapes", "do_sample", "has_eos"))
def _select_program(scores, seq, write_at, unfinished, steps_alive, pos, eos, pad, key, *, shapes, do_sample,
                    has_eos):
    """The token choice and its bookkeeping, one program per (batch, vocab, buffer) shape: argmax, or a
    draw from softmax(scores) (as ``torch.multinomial`` of it, with the key of the global tpu stream);
    rows already finished get ``pad``; the token is written at column ``write_at`` of ``seq``, and the
    position ids advance. Inputs come flat (the storages' own buffers) and are shaped here."""
    scores, seq, pos = (a.reshape(shape) for a, shape in zip((scores, seq, pos), shapes))
    write_at, steps_alive, pad = write_at.reshape(()), steps_alive.reshape(()), pad.reshape(())
    if do_sample:
        token = jax.random.categorical(jax.random.wrap_key_data(key), scores, axis=-1)
    else:
        token = jnp.argmax(scores, axis=-1)
    token = token.astype(seq.dtype)
    if has_eos:
        token = token * unfinished + pad * (1 - unfinished)
        unfinished = unfinished & ~jnp.isin(token, eos)
    alive = unfinished.max()
    seq = jax.lax.dynamic_update_slice(seq, token[:, None], (jnp.zeros((), write_at.dtype), write_at))
    return token[:, None], seq, write_at + 1, unfinished, steps_alive + alive, alive, pos + 1


_NO_EOS = np.zeros((1,), np.int64)


def _select(scores, seq, write_at, unfinished, steps_alive, pos, eos, pad, do_sample: bool):
    """:func:`_select_program` on tpu tensors (a JAX program: Dynamo does not trace torchtpu's own code,
    so a ``torch.compile`` here would run op by op). Returns (the token as a column, seq, write_at + 1,
    unfinished, steps_alive + any row unfinished, that flag, pos + 1) as new tensors."""
    from .interop import from_jax, to_jax

    key = rng.next_key_data() if do_sample else np.zeros(2, np.uint32)
    outs = _select_program(*(to_jax(t.contiguous(), flat=True) for t in (scores, seq, write_at, unfinished,
                                                                         steps_alive, pos)),
                           _NO_EOS if eos is None else to_jax(eos, flat=True), to_jax(pad, flat=True), key,
                           shapes=(tuple(scores.shape), tuple(seq.shape), tuple(pos.shape)), do_sample=do_sample,
                           has_eos=eos is not None)
    return tuple(from_jax(o) for o in outs)


def _host_setup(input_ids, mask, positions, left, padded, length, pad_value):
    """The buffers of one call, built on the host from the prompt (a few small copies, no device
    program per prompt length): the left-padded prompt, the ``[batch, length]`` sequence buffer and
    attention mask, the prompt's position ids, and the next position per row."""
    pad = torch.nn.functional.pad
    ids = input_ids.cpu()
    mask = torch.ones_like(ids) if mask is None else mask.cpu().long()
    if positions is None:
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # Hugging Face's position ids
    else:
        positions = positions.cpu()
    prefill_ids = pad(ids, (left, 0), value=pad_value)
    seq = pad(prefill_ids, (0, length - padded), value=pad_value)
    full_mask = pad(pad(mask, (left, 0), value=0), (0, length - padded), value=1)
    return prefill_ids, seq, full_mask, pad(positions, (left, 0), value=0), positions[:, -1:] + 1


def _fixed_shape_sample(model, input_ids, logits_processor, stopping_criteria, cfg, model_kwargs):
    from transformers.cache_utils import StaticCache
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    batch, prompt = input_ids.shape
    max_length = min(c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria))
    new_tokens = max(max_length - prompt, 0)
    dev = input_ids.device
    eos = [c.eos_token_id for c in stopping_criteria if isinstance(c, EosTokenCriteria)]
    eos = torch.cat([e.reshape(-1).cpu() for e in eos]).to(dev) if eos else None
    pad_value = cfg._pad_token_tensor
    pad_value = int(pad_value) if pad_value is not None else 0
    if new_tokens == 0:
        return input_ids

    padded = LENGTHS.bucket(prompt)
    left = padded - prompt
    length = LENGTHS.bucket(padded + new_tokens)
    host = _host_setup(input_ids, model_kwargs.get("attention_mask"), model_kwargs.get("position_ids"), left,
                       padded, length, pad_value)
    prefill_ids, seq, full_mask, prefill_pos, pos = (t.to(dev) for t in host)
    write_at = torch.tensor(padded, dtype=torch.long).to(dev)  # the buffer column of the next token
    unfinished = torch.ones(batch, dtype=torch.long).to(dev)
    steps_alive = torch.zeros((), dtype=torch.long).to(dev)  # steps after which some row was unfinished
    pad_t = torch.tensor(pad_value, dtype=torch.long).to(dev)

    cache = StaticCache(config=model.config, max_cache_len=length)
    common = dict(attention_mask=full_mask, past_key_values=cache, use_cache=True, return_dict=True)
    if model._supports_logits_to_keep():
        common["logits_to_keep"] = 1
    forward = _programs(model)
    feed = dict(input_ids=prefill_ids, position_ids=prefill_pos, **common)
    done = new_tokens
    for step in range(new_tokens):
        scores = logits_processor(seq[:, left:padded + step], forward(**feed))
        token, seq, write_at, unfinished, steps_alive, alive, next_pos = _select(
            scores, seq, write_at, unfinished, steps_alive, pos, eos, pad_t, bool(cfg.do_sample))
        if eos is not None and (step + 1) % SYNC_EVERY == 0 and step + 1 < new_tokens and int(alive) == 0:
            done = int(steps_alive) + 1
            break
        feed = dict(input_ids=token, position_ids=pos, **common)
        pos = next_pos
    if eos is not None and done == new_tokens:
        done = min(int(steps_alive) + 1, new_tokens)
    return seq[:, left:padded + done]
