"""KV-cached rollout of Hugging Face causal LMs (torchtpu_rl.hf_cache + RolloutEngine) against
``transformers``' own ``generate`` on torch CPU, and the learner's recompute of the same log-probs.

Every family runs through the engine on the cpu device (the same cache, mask and position code,
fast); two also run on tpu with the compiled prefill/decode programs: Qwen2 in float32 (sdpa
attention) and Gemma2 in bfloat16 (eager attention, sliding window, soft-capping). The learner's
side of the agreement on tpu is in test_learner_scale.py.
"""

import copy
import warnings

import pytest
import torch
import transformers
from helpers import HF_CAUSAL_LM_FAMILIES, no_fallback, tiny_hf_causal_lm

from torchtpu.bucketing import BucketPolicy
from torchtpu_rl import RolloutEngine, SamplingParams, sequence_logprobs
from torchtpu_rl.hf_cache import GROUPED_ATTENTION, SlotCache, grouped_attention, kv_cache_support

VOCAB = 96
PROMPTS = [[5, 17, 33, 8, 61, 9, 70], [44, 12, 90], [3, 3, 81, 27, 50], [66]]
BUCKETS = dict(prompt_buckets=BucketPolicy.pow2(8, 32), response_buckets=BucketPolicy.pow2(8, 32))


def _model(family, seed=0, **config):
    if family in ("mistral", "gemma2"):
        config.setdefault("sliding_window", 4)  # shorter than prompt + response: the window matters
    return tiny_hf_causal_lm(family, vocab_size=VOCAB, seed=seed, **config)


def _hf_greedy(model, prompts, n):
    """Hugging Face ``generate`` (torch CPU, left padding, no stop token): tokens (B, n) and the
    log-prob of each under log_softmax of its logits."""
    P = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), P, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, P - len(p):] = torch.tensor(p)
        mask[i, P - len(p):] = 1
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=0,
                         eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    toks = out.sequences[:, P:]
    logp = torch.stack([torch.log_softmax(lg.float(), -1).gather(-1, toks[:, j:j + 1])[:, 0]
                        for j, lg in enumerate(out.logits)], 1)
    return toks, logp


def _recompute(model, batch, device):
    """The learner's log-probs of the batch's response tokens (one full forward, no cache)."""
    with torch.no_grad():
        lp = sequence_logprobs(model, batch.input_ids.to(device), batch.attention_mask.to(device),
                               batch.response_mask.to(device), temperature=batch.temperature or 1.0)
    return lp.cpu()


@pytest.mark.parametrize("family", HF_CAUSAL_LM_FAMILIES)
def test_cached_rollout_matches_hf_generate(family):
    model = _model(family)
    assert kv_cache_support(model) == (True, "")
    ref_tok, ref_logp = _hf_greedy(model, PROMPTS, 8)
    eng = RolloutEngine(model, 0, device="cpu", **BUCKETS)
    assert eng.use_kv_cache
    assert model.config._attn_implementation == GROUPED_ATTENTION  # these configs have 2 kv heads for 4
    batch = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert isinstance(next(iter(eng._caches.values())), SlotCache)
    assert torch.equal(batch.response_ids, ref_tok)
    torch.testing.assert_close(batch.logprobs, ref_logp, atol=1e-5, rtol=0)
    # sampled (temperature, top-k, top-p): the rollout's log-probs are the learner's recompute
    sampled = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9))
    torch.testing.assert_close(sampled.logprobs, _recompute(model, sampled, "cpu"), atol=1e-5, rtol=0)


@pytest.mark.parametrize("L", [1, 5])
def test_grouped_attention_is_hf_sdpa_attention(L):
    """Against transformers' own sdpa attention (key/value heads repeated), with a padding mask,
    for a decode step (1 query) and a prefill (5)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 6, L, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8,
                                                                                                     generator=g)
    mask = torch.rand(2, 1, L, 9, generator=g) > 0.3
    mask[..., 0] = True  # no query without a key
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal, module.training = 3, True, False
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    got, _ = grouped_attention(module, q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def qwen2_engine():
    """A compiled tpu engine of a tiny Qwen2 (shared: its programs compile once for the module)."""
    return RolloutEngine(_model("qwen2"), 0, device="tpu", compile=True, **BUCKETS)


@pytest.mark.parametrize("family,dtype", [("qwen2", torch.float32), ("gemma2", torch.bfloat16)])
def test_compiled_cached_rollout_on_tpu_matches_hf_generate(family, dtype, qwen2_engine, metrics):
    model = _model(family).to(dtype)
    other = [[7, 8, 9, 10, 11, 12], [13, 14], [15, 16, 17]]  # 3 rows: the batch bucket of 4 again
    ref_tok, ref_logp = _hf_greedy(model, PROMPTS, 6)
    ref_other = _hf_greedy(model, other, 6)[0]
    if family == "qwen2":
        eng = qwen2_engine
    else:
        eng = RolloutEngine(copy.deepcopy(model), 0, device="tpu", compile=True, **BUCKETS)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    with no_fallback():
        batch = eng.generate(PROMPTS, greedy)
    assert eng.use_kv_cache
    assert next(iter(eng._caches.values())).layers[0].keys.dtype == dtype
    assert torch.equal(batch.response_ids, ref_tok)
    # bfloat16 sums in another order than torch CPU's: the same tokens, log-probs to bf16 precision
    torch.testing.assert_close(batch.logprobs, ref_logp, atol=2e-5 if dtype == torch.float32 else 0.05, rtol=0)
    # other prompt lengths and batch sizes inside the same buckets reuse the programs
    compiles = metrics.snapshot()["compiles"]
    again = eng.generate(other, greedy)
    assert metrics.snapshot()["compiles"] == compiles
    assert torch.equal(again.response_ids, ref_other)


def test_weight_swap_drops_the_cache_and_keeps_the_compiled_steps(qwen2_engine, metrics):
    eng = qwen2_engine
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    eng.generate(PROMPTS, greedy)
    assert eng._caches
    new = _model("qwen2", seed=1)
    compiles = metrics.snapshot()["compiles"]
    eng.update_weights(new.state_dict(), policy_version=3)
    assert not eng._caches  # dropped while the weights changed
    batch = eng.generate(PROMPTS, greedy)
    assert metrics.snapshot()["compiles"] == compiles  # weights copied in place: same programs
    assert batch.policy_version.tolist() == [3] * len(PROMPTS)
    ref_tok, ref_logp = _hf_greedy(new, PROMPTS, 6)
    assert torch.equal(batch.response_ids, ref_tok)
    torch.testing.assert_close(batch.logprobs, ref_logp, atol=2e-5, rtol=0)


def _gpt_neo():
    """GPT-Neo: a causal LM whose Hugging Face class declares no static-cache support."""
    cfg = transformers.GPTNeoConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                                    attention_types=[[["global", "local"], 1]], window_size=4,
                                    max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def test_uncacheable_family_recomputes_with_one_warning():
    model = _gpt_neo()
    ok, why = kv_cache_support(model)
    assert not ok and "GPTNeoForCausalLM" in why
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eng = RolloutEngine(model, 0, device="cpu", **BUCKETS)
        RolloutEngine(model, 0, device="cpu", **BUCKETS)
    msgs = [str(w.message) for w in caught if "KV cache" in str(w.message)]
    assert len(msgs) == 1 and "gpt_neo" in msgs[0] and "_can_compile_fullgraph" in msgs[0], msgs
    assert not eng.use_kv_cache
    # the full recompute gives Hugging Face models positions from the mask: same as generate
    batch = eng.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0.0))
    ref_tok, ref_logp = _hf_greedy(model, PROMPTS, 5)
    assert torch.equal(batch.response_ids, ref_tok)
    torch.testing.assert_close(batch.logprobs, ref_logp, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="use_kv_cache=True, but GPTNeoForCausalLM"):
        RolloutEngine(model, 0, device="cpu", use_kv_cache=True)
