"""The request-level rollout engine (torchtpu_rl.serving, torchtpu_rl.kv_pages): continuous batching
over a paged KV cache, prefix sharing, per-request sampling streams, preemption, weight updates in
flight, bad input.

Tiny Hugging Face models built locally (tests/helpers.py), on the cpu device (the same cache, mask
and scheduling code as on tpu, fast); one test runs the compiled programs on tpu for the compile
counts.
"""

import threading

import pytest
import torch
from helpers import tiny_hf_causal_lm

import torchtpu
from torchtpu.bucketing import BucketPolicy
from torchtpu_rl import RolloutEngine, SamplingParams
from torchtpu_rl.kv_pages import PageAllocator, PrefixCache
from torchtpu_rl.serving import ServingEngine, sample_rows, stream_uniform

VOCAB = 96
PROMPTS = [[5, 17, 33, 8, 61, 9, 70], [44, 12, 90], [3, 3, 81, 27, 50], [66], [44, 12, 90],
           [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [20, 21]]
STATIC = dict(prompt_buckets=BucketPolicy.pow2(8, 64), response_buckets=BucketPolicy.pow2(8, 32))


def _model(family="qwen2", seed=0):
    config = {"sliding_window": 4} if family in ("mistral", "gemma2") else {}
    return tiny_hf_causal_lm(family, vocab_size=VOCAB, seed=seed, **config)


def _engine(family="qwen2", seed=0, **kw):
    kw.setdefault("device", "cpu")
    return ServingEngine(_model(family, seed), 0, **kw)


def _reference(family, prompts, params):
    return RolloutEngine(_model(family), 0, device="cpu", **STATIC).generate(prompts, params)


# ================================================================= greedy: today's engine, token for token
@pytest.mark.parametrize("family", ["qwen2", "llama", "gemma2"])
@pytest.mark.parametrize("slots,page_size,order", [(2, 4, "as_given"), (4, 8, "reversed"), (16, 16, "shuffled"),
                                                   (3, 1, "as_given")])
def test_greedy_matches_rollout_engine(family, slots, page_size, order):
    prompts = list(PROMPTS)
    if order == "reversed":
        prompts = prompts[::-1]
    elif order == "shuffled":
        g = torch.Generator().manual_seed(1)
        prompts = [prompts[i] for i in torch.randperm(len(prompts), generator=g).tolist()]
    params = SamplingParams(max_new_tokens=10, temperature=0.0, stop_token_ids=(7,))
    ref = _reference(family, prompts, params)
    eng = _engine(family, max_slots=slots, page_size=page_size)
    out = eng.generate(prompts, params)
    assert torch.equal(out.response_ids, ref.response_ids)
    assert torch.equal(out.response_mask, ref.response_mask)
    assert torch.equal(out.stopped, ref.stopped)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    st = eng.last_stats
    assert st["useful_tokens"] == out.num_response_tokens
    assert 0 < st["row_utilization"] <= 1
    assert st["kv_pages_peak"] <= eng.kv_pages and st["preemptions"] == 0


def test_slots_refill_as_sequences_finish():
    """Short and long requests under 2 slots: a finished short one's slot is taken at once, so the
    decode rows are never more than the live sequences' bucket and utilization stays high."""
    eng = _engine(max_slots=2, page_size=4)
    lengths = [2, 12, 3, 3, 2, 12]
    for i, n in enumerate(lengths):
        eng.submit([10 + i, 11, 12], SamplingParams(max_new_tokens=n, temperature=0.0), request_id=f"r{i}")
    order = [out.request_id for out in eng.stream()]
    assert sorted(order) == [f"r{i}" for i in range(6)]
    assert order.index("r0") < order.index("r1")  # r0 (2 tokens) ends first; r2 takes its slot
    batch = eng.generate([[10, 11, 12]] * 1 + [[13, 14]], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert batch.response_lengths.tolist() == [4, 4]


def test_chunked_prefill_keeps_decoding():
    """A prompt longer than the step's token budget is prefilled over several steps while running
    sequences keep decoding one token a step; the tokens are those of an unchunked run."""
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    long_prompt = list(range(3, 40))
    eng = _engine(max_slots=4, page_size=4, prefill_tokens_per_step=5)
    eng.submit([5, 6, 7], params, request_id="short")
    eng.step()
    eng.submit(long_prompt, params, request_id="long")
    short = eng._requests["short"].seqs[0]
    for k in range(5):  # 37 tokens at 5 a step: the long prompt is still prefilling
        before = short.generated
        eng.step()
        assert short.generated == before + 1
    outs = {o.request_id: o for o in eng.stream()}
    ref = _reference("qwen2", [[5, 6, 7], long_prompt], params)
    assert [outs["short"].samples[0].tokens, outs["long"].samples[0].tokens] == ref.responses()


# ================================================================= sampling streams
def test_sampled_request_independent_of_batch_mates():
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=20, top_p=0.9)
    alone = _engine(max_slots=4, page_size=4)
    alone.submit(PROMPTS[0], params, n=2, request_id="target", seed=7)
    solo = next(iter(alone.stream()))

    crowd = _engine(max_slots=8, page_size=4)
    g = torch.Generator().manual_seed(0)
    for i in range(30):
        p = torch.randint(3, VOCAB, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
        crowd.submit(p, SamplingParams(max_new_tokens=int(torch.randint(1, 16, (1,), generator=g)),
                                       temperature=0.7), request_id=f"other{i}", n=2)
        if i == 13:
            crowd.submit(PROMPTS[0], params, n=2, request_id="target", seed=7)
    outs = {o.request_id: o for o in crowd.stream()}
    mixed = outs["target"]
    for a, b in zip(solo.samples, mixed.samples):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)
    assert solo.samples[0].tokens != solo.samples[1].tokens  # the n samples have their own streams


def test_sampled_logprobs_are_the_learners_recompute():
    from torchtpu_rl import sequence_logprobs

    eng = _engine(max_slots=4, page_size=4)
    batch = eng.generate(PROMPTS, SamplingParams(max_new_tokens=8, temperature=0.8, top_k=20, top_p=0.9))
    with torch.no_grad():
        lp = sequence_logprobs(eng.model, batch.input_ids, batch.attention_mask, batch.response_mask,
                               temperature=0.8)
    torch.testing.assert_close(batch.logprobs, lp, atol=1e-5, rtol=0)


def test_stream_uniform_is_a_function_of_key_and_position():
    key = torch.tensor([1, 2, 1, 2 ** 32 - 1])
    pos = torch.tensor([5, 5, 6, 0])
    u = stream_uniform(key, pos, 1000)
    assert bool(((u > 0) & (u < 1)).all())
    assert torch.equal(stream_uniform(key[2:3], pos[2:3], 1000), u[2:3])
    assert not torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert abs(float(u.mean()) - 0.5) < 0.02
    # temperature 0 rows are argmax rows whatever their key
    logits = torch.randn(4, 50)
    tok, _ = sample_rows(logits, torch.zeros(4), torch.ones(4, dtype=torch.bool), torch.zeros(4, dtype=torch.int64),
                         torch.full((4,), 2.0), key, pos, filtered=True)
    assert torch.equal(tok, logits.argmax(-1))


# ================================================================= prefix sharing
def test_group_prefills_its_prompt_once():
    prompt = list(range(3, 3 + 21))  # 21 tokens: five full pages of 4 and a partial one
    eng = _engine(max_slots=8, page_size=4)
    batch = eng.generate([prompt] * 8, SamplingParams(max_new_tokens=6, temperature=1.0))
    st = eng.last_stats
    assert st["prefill_tokens"] == len(prompt)
    assert st["forked_samples"] == 7
    assert len({tuple(r) for r in batch.responses()}) > 1  # forks sample on their own streams
    # the copy-on-write page: greedy samples of a group equal a lone greedy run
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    group = eng.generate([prompt] * 8, greedy)
    lone = _engine(max_slots=1, page_size=4, prefix_cache=False).generate([prompt], greedy)
    for r in group.responses():
        assert r == lone.responses()[0]
    # the prompt's full blocks were cached by the first call: hits, and only the tail recomputed
    assert eng.last_stats["prefix_hit_tokens"] == 20
    assert eng.last_stats["prefill_tokens"] == 1


def test_group_larger_than_the_slots_recomputes_one_token_per_later_sample():
    prompt = list(range(3, 3 + 21))
    params = SamplingParams(max_new_tokens=5, temperature=1.0)
    eng = _engine(max_slots=3, page_size=4)
    out = eng.generate([prompt] * 8, params)
    # 3 samples prefill together (21 tokens once); each later admission copies the cached last block
    # and computes one token (samples admitted in the same step fork from it)
    waves = eng.last_stats["prefill_tokens"] - len(prompt)
    assert 1 <= waves <= 5
    assert eng.last_stats["prefix_hit_tokens"] == waves * (len(prompt) - 1)
    ample = _engine(max_slots=8, page_size=4).generate([prompt] * 8, params)
    assert torch.equal(out.response_ids, ample.response_ids)
    torch.testing.assert_close(out.logprobs, ample.logprobs, atol=1e-5, rtol=0)


def test_prefix_cache_serves_the_next_turn():
    eng = _engine(max_slots=4, page_size=4)
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    turn1 = eng.generate([PROMPTS[5]], params)
    convo = PROMPTS[5] + turn1.responses()[0] + [30, 31, 32]
    turn2 = eng.generate([convo], params)
    assert eng.last_stats["prefix_hit_tokens"] >= 16
    assert eng.last_stats["prefill_tokens"] == len(convo) - eng.last_stats["prefix_hit_tokens"]
    cold = _engine(max_slots=4, page_size=4, prefix_cache=False).generate([convo], params)
    assert turn2.responses() == cold.responses()
    torch.testing.assert_close(turn2.logprobs, cold.logprobs, atol=1e-5, rtol=0)


def test_prefix_cache_lru_evicts_tails_first():
    alloc = PageAllocator(6, 2)
    cache = PrefixCache(alloc)
    pages = [alloc.alloc() for _ in range(3)]
    cache.insert([1, 2, 3, 4, 5, 6], pages)
    for p in pages:
        alloc.decref(p)  # only the cache holds them now
    assert cache.lookup([1, 2, 3, 4, 9, 9], 3) == pages[:2]
    for p in pages[:2]:
        alloc.decref(p)
    assert cache.hits == 2
    assert cache.evict_one() and len(cache) == 2
    assert cache.lookup([1, 2, 3, 4, 5, 6], 3) == pages[:2]  # the tail went first


# ================================================================= paged KV and preemption
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_preemption_under_a_tiny_budget_gives_the_same_tokens(temperature):
    params = SamplingParams(max_new_tokens=14, temperature=temperature)
    prompts = PROMPTS + [[40, 41, 42, 43]] * 3
    ample = _engine(max_slots=8, page_size=4)
    ref = ample.generate(prompts, params)
    assert ample.last_stats["preemptions"] == 0
    # 7 pages of 4: one sequence of 11 + 14 tokens fits alone, eight at once do not
    tight = _engine(max_slots=8, page_size=4, kv_pages=7)  # a fresh engine: the same request ids
    out = tight.generate(prompts, params)
    assert tight.last_stats["preemptions"] > 0
    assert tight.last_stats["kv_pages_peak"] <= 7
    assert torch.equal(out.response_ids, ref.response_ids)
    torch.testing.assert_close(out.logprobs, ref.logprobs, atol=1e-5, rtol=0)


def test_kv_pages_are_what_sequences_hold():
    eng = _engine(max_slots=16, page_size=8)
    eng.generate([[5, 6, 7]] * 4 + [[9]], SamplingParams(max_new_tokens=5, temperature=0.0))
    # 3 + 5 tokens: one page a sequence (the group shares no full page, each copies the partial
    # one), and the prefix cache's copy of each prompt's last block
    assert eng.last_stats["kv_pages_peak"] == 5 + 2
    assert eng.last_stats["kv_bytes_peak"] == 7 * 8 * eng.token_bytes
    assert eng.pages.used == len(eng.prefix)  # after the call only the prefix cache holds pages


# ================================================================= weight updates in flight
def _perturbed(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def _submit_all(eng, params):
    for i, p in enumerate(PROMPTS):
        eng.submit(p, params, request_id=f"q{i}", n=2)


def test_update_abort_requeues_under_new_weights():
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    eng = _engine(max_slots=4, page_size=4)
    new = _perturbed(eng.model)
    _submit_all(eng, params)
    early = []
    for _ in range(4):
        early += eng.step()
    eng.update_weights(new, policy_version=5, mode="abort")
    outs = {o.request_id: o for o in early + list(eng.stream())}
    fresh = _engine(max_slots=4, page_size=4)
    fresh.load_state_dict(new)
    _submit_all(fresh, params)
    want = {o.request_id: o for o in fresh.stream()}
    for rid, out in outs.items():
        if any(o.request_id == rid for o in early):
            continue  # finished before the update, under version 0
        for a, b in zip(out.samples, want[rid].samples):
            assert a.versions == [5] * len(a.tokens)
            assert a.tokens == b.tokens  # restarted from the prompt: as if sampled under the new weights only


def test_update_continue_records_versions_per_token():
    params = SamplingParams(max_new_tokens=12, temperature=0.0)
    eng = _engine(max_slots=8, page_size=4)
    _submit_all(eng, params)
    for _ in range(3):
        assert not eng.step()
    eng.update_weights(_perturbed(eng.model), policy_version=1, mode="continue")
    outs = list(eng.stream())
    mixed = 0
    for out in outs:
        for s in out.samples:
            assert s.versions == sorted(s.versions) and set(s.versions) <= {0, 1}
            mixed += len(set(s.versions)) == 2
    assert mixed > 0
    batch = outs[0].to_batch()
    assert batch.token_versions.shape == batch.response_ids.shape
    assert int(batch.policy_version[0]) == 0


def test_update_finish_lets_running_sequences_finish():
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    eng = _engine(max_slots=2, page_size=4)
    _submit_all(eng, params)  # 14 sequences, 2 slots
    eng.step()
    eng.update_weights(_perturbed(eng.model), policy_version=3, mode="finish")
    outs = list(eng.stream())
    versions = [set(s.versions) for o in outs for s in o.samples]
    assert {0} in versions and {3} in versions and all(len(v) == 1 for v in versions)


def test_update_from_another_thread_while_generate_runs():
    eng = _engine(max_slots=2, page_size=4)
    new = _perturbed(eng.model)
    started = threading.Event()
    orig = eng._step

    def step():
        started.set()
        orig()

    eng._step = step
    result = {}
    t = threading.Thread(target=lambda: result.update(b=eng.generate(PROMPTS * 3, SamplingParams(
        max_new_tokens=12, temperature=0.0))))
    t.start()
    started.wait(30)
    eng.update_weights(new, policy_version=9, mode="continue")
    t.join(120)
    assert not t.is_alive()
    assert eng.policy_version == 9
    tv = result["b"].token_versions
    assert set(tv.unique().tolist()) <= {0, 9} and bool((tv.diff(dim=1) >= 0).all())


def test_wrong_update_is_refused_before_anything_is_touched():
    params = SamplingParams(max_new_tokens=8, temperature=0.0)
    eng = _engine(max_slots=4, page_size=4)
    ref = _engine(max_slots=4, page_size=4)
    _submit_all(eng, params)
    _submit_all(ref, params)
    eng.step()
    ref.step()
    bad = dict(eng.model.state_dict())
    name = next(iter(bad))
    bad[name] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=name):
        eng.update_weights(bad, mode="abort")
    with pytest.raises(KeyError, match="nope"):
        eng.update_weights({**eng.model.state_dict(), "nope": torch.zeros(1)}, mode="continue")
    with pytest.raises(ValueError, match="mode"):
        eng.update_weights(eng.model.state_dict(), mode="later")
    a = {o.request_id: [s.tokens for s in o.samples] for o in eng.stream()}
    b = {o.request_id: [s.tokens for s in o.samples] for o in ref.stream()}
    assert a == b and eng.policy_version == 0


def test_pause_resume_and_load_state_dict():
    eng = _engine(max_slots=4, page_size=4)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    before = eng.generate(PROMPTS, params)
    new = _perturbed(eng.model)
    eng.pause()
    assert eng.paused
    with pytest.raises(RuntimeError, match="resume"):
        eng.generate(PROMPTS, params)
    eng.load_state_dict(new)
    eng.resume()
    after = eng.generate(PROMPTS, params)
    fresh = _engine(max_slots=4, page_size=4)
    fresh.load_state_dict(new)
    assert torch.equal(after.response_ids, fresh.generate(PROMPTS, params).response_ids)
    assert not torch.equal(after.response_ids, before.response_ids)


# ================================================================= bad input
def test_bad_requests_name_what_is_wrong():
    eng = _engine(max_slots=2, page_size=4, kv_pages=3)
    with pytest.raises(ValueError, match=r"'long'.*context"):
        eng.submit([5] * 250, SamplingParams(max_new_tokens=10), request_id="long")
    with pytest.raises(ValueError, match=r"'big'.*budget"):
        eng.submit([5] * 10, SamplingParams(max_new_tokens=10), request_id="big")  # 20 tokens: 5 pages of 4
    with pytest.raises(ValueError, match="vocabulary"):
        eng.submit([5], SamplingParams(stop_token_ids=(VOCAB,)), request_id="stop")
    with pytest.raises(ValueError, match=r"'oov'.*outside"):
        eng.submit([VOCAB + 1], request_id="oov")
    for field, kw in (("temperature", dict(temperature=-1.0)), ("top_p", dict(top_p=0.0)),
                      ("top_k", dict(top_k=-2)), ("max_new_tokens", dict(max_new_tokens=0))):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    with pytest.raises(KeyError, match="ghost"):
        eng.abort(["ghost"])
    eng.submit([5, 6], SamplingParams(max_new_tokens=3), request_id="dup")
    with pytest.raises(ValueError, match="dup"):
        eng.submit([5, 6], SamplingParams(max_new_tokens=3), request_id="dup")
    eng.abort("dup")
    assert not eng.has_unfinished() and eng.pages.used == 0
    with pytest.raises(ValueError, match="non-empty"):
        eng.generate([])


def test_abort_mid_stream_frees_pages():
    eng = _engine(max_slots=4, page_size=4, prefix_cache=False)
    for i, p in enumerate(PROMPTS):
        eng.submit(p, SamplingParams(max_new_tokens=20, temperature=0.0), request_id=f"a{i}")
    eng.step()
    eng.step()
    assert eng.pages.used > 0
    eng.abort([f"a{i}" for i in range(0, len(PROMPTS), 2)])
    got = sorted(o.request_id for o in eng.stream())
    assert got == [f"a{i}" for i in range(1, len(PROMPTS), 2)]
    assert eng.pages.used == 0


# ================================================================= colocated mode: KV memory released and taken back
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_release_memory_mid_stream_then_resume_gives_the_same_tokens(temperature):
    """Released mid-stream (a colocated learner takes the device), the running sequences are requeued
    with their tokens, nothing steps until resume_memory(), and after it every request gets the tokens
    of an uninterrupted run."""
    params = SamplingParams(max_new_tokens=9, temperature=temperature)
    ref = _engine(max_slots=4, page_size=4)
    for i, p in enumerate(PROMPTS):
        ref.submit(p, params, request_id=f"r{i}", seed=3)
    want = {o.request_id: o.samples[0].tokens for o in ref.stream()}

    eng = _engine(max_slots=4, page_size=4)
    for i, p in enumerate(PROMPTS):
        eng.submit(p, params, request_id=f"r{i}", seed=3)
    for _ in range(4):
        eng.step()
    assert eng.pages.used > 0
    freed = eng.release_memory()
    assert freed == eng.cache.nbytes > 0 and eng.memory_released
    assert eng.pages.used == 0 and not eng._running and len(eng.prefix) == 0
    eng.submit([9, 9, 9], params, request_id="late", seed=3)  # queueing is allowed while released
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.step()
    with pytest.raises(RuntimeError, match="resume_memory"):
        eng.generate([[1, 2]], params)
    with pytest.raises(RuntimeError, match="already released"):
        eng.release_memory()
    eng.resume_memory()
    with pytest.raises(RuntimeError, match="not released"):
        eng.resume_memory()
    got = {o.request_id: o.samples[0].tokens for o in eng.stream()}
    assert {k: v for k, v in got.items() if k != "late"} == want
    assert len(got["late"]) == 9


def test_release_memory_frees_the_device_pools_and_resume_compiles_nothing():
    """On tpu the pools' bytes leave the device's allocated memory, a weight update still goes in while
    released, and the programs built before serve the re-allocated pools (no compile)."""
    prompts = PROMPTS[:4]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    eng = _engine(device="tpu", compile=True, max_slots=4, page_size=8, kv_pages=64,
                  slot_buckets=BucketPolicy.explicit([4]), page_buckets=BucketPolicy.explicit([2]),
                  token_buckets=BucketPolicy.explicit([8]))
    first = eng.generate(prompts, params)
    before = torch.tpu.memory_allocated()
    freed = eng.release_memory()
    assert before - torch.tpu.memory_allocated() >= freed == eng.cache.nbytes
    eng.update_weights(eng.model.state_dict(), mode="finish")  # a weight sync while the learner holds the device
    eng.resume_memory()
    assert torch.tpu.memory_allocated() - (before - freed) >= freed
    again = eng.generate(prompts, params)
    assert eng.last_stats["compiles"] == 0
    assert torch.equal(again.response_ids, first.response_ids)


# ================================================================= quantized, LoRA and lower-precision policies
def _small(seed=0):
    return tiny_hf_causal_lm("qwen2", vocab_size=VOCAB, num_layers=1, seed=seed)


@pytest.mark.parametrize("option", ["int8", "lora", "bfloat16"])
def test_quantized_lora_and_dtype_policies_match_the_static_engine(option):
    """The serving engine takes RolloutEngine's quantization / lora / dtype options: greedy tokens equal
    the static engine's with the same option, before and after a weight update (re-quantized, adapters
    merged, cast from the learner's float32)."""
    if option == "int8":
        pytest.importorskip("torchao")
        kw = dict(quantization="int8")
    elif option == "lora":
        pytest.importorskip("peft")
        from torchtpu_rl.lora import LoraSpec

        kw = dict(lora=LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj")))
    else:
        kw = dict(dtype=torch.bfloat16)
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    prompts = PROMPTS[:4]
    dev = "tpu" if option == "int8" else "cpu"
    eng = ServingEngine(_small(), 0, device=dev, compile=False, max_slots=4, page_size=4, **kw)
    ref = RolloutEngine(_small(), 0, device=dev, compile=False, **STATIC, **kw)
    if option == "int8":
        assert len(eng.quantized_layers) == 7 and "lm_head" not in eng.quantized_layers
    tol = 1e-2 if option == "bfloat16" else 1e-4
    for version in (0, 1):
        out, want = eng.generate(prompts, params), ref.generate(prompts, params)
        assert torch.equal(out.response_ids, want.response_ids)
        torch.testing.assert_close(out.logprobs, want.logprobs, atol=tol, rtol=0)
        if version == 0:
            if option == "lora":
                from torchtpu_rl.lora import adapter_state_dict

                learner = kw["lora"].apply(_small())
                with torch.no_grad():
                    for name, prm in learner.named_parameters():
                        if "lora_" in name:
                            prm.copy_(torch.randn_like(prm) * 0.3)
                update = adapter_state_dict(learner)
                with pytest.raises(ValueError, match="is not an adapter tensor"):
                    eng.update_weights({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight":
                                        torch.zeros(4, 32)})
            else:
                update = _small(seed=1).state_dict()
                assert all(v.dtype == torch.float32 for v in eng.sync_reference().values())
            eng.update_weights(update, policy_version=1)
            ref.update_weights(update, policy_version=1)
    assert out.policy_version.tolist() == [1] * len(prompts)


# ================================================================= tpu: compiled programs, no steady-state compiles
def test_compiled_on_tpu_matches_and_compiles_nothing_in_steady_state(metrics):
    # (the metrics fixture resets the counters: a fallback of another test file's op must not count here)
    prompts = PROMPTS[:4]
    params = SamplingParams(max_new_tokens=6, temperature=0.0)
    ref = _reference("qwen2", prompts, params)
    eng = _engine(device="tpu", compile=True, max_slots=4, page_size=8,
                  slot_buckets=BucketPolicy.explicit([4]), page_buckets=BucketPolicy.explicit([2]),
                  token_buckets=BucketPolicy.explicit([8]))
    first = eng.generate(prompts, params)
    assert torch.equal(first.response_ids, ref.response_ids)
    torch.testing.assert_close(first.logprobs, ref.logprobs, atol=1e-5, rtol=0)
    again = eng.generate(prompts, params)
    assert eng.last_stats["compiles"] == 0
    assert torch.equal(again.response_ids, first.response_ids)
    # sampled: the device-side stream hash draws on XLA what it draws on torch's cpu
    sampled = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=30)
    cpu = _engine(max_slots=4, page_size=8)
    outs = []
    for e in (eng, cpu):
        for i, p in enumerate(prompts):
            e.submit(p, sampled, request_id=f"t{i}", seed=11)
        outs.append({o.request_id: o.samples[0] for o in e.stream()})
    for rid, s in outs[0].items():
        assert s.tokens == outs[1][rid].tokens
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(outs[1][rid].logprobs), atol=1e-5, rtol=0)
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == {}


def test_rollout_batch_token_versions_travel_with_the_rows():
    eng = _engine(max_slots=4, page_size=4)
    a = eng.generate(PROMPTS[:3], SamplingParams(max_new_tokens=4, temperature=0.0))
    b = RolloutEngine(_model(), 0, device="cpu", **STATIC).generate(PROMPTS[3:5], SamplingParams(max_new_tokens=6, temperature=0.0))
    assert b.token_versions is None
    both = type(a).concat([a, b])
    assert both.token_versions.shape == both.response_ids.shape
    assert torch.equal(both.token_versions[3:], torch.zeros(2, 6, dtype=torch.int64))
    assert torch.equal(both.select([0, 4]).token_versions, both.token_versions[[0, 4]])
    again = type(a).from_state(both.state())
    assert torch.equal(again.token_versions, both.token_versions)
    with pytest.raises(ValueError, match="token_versions"):
        type(a)(**{**a.state(), "token_versions": torch.zeros(1, 1, dtype=torch.int64)})
