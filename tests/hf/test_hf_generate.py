"""Hugging Face ``model.generate`` on tpu through torchtpu.hf_generate: after a warm-up, a call
compiles nothing (static and dynamic cache, greedy and sampling), and greedy output is
token-exact with the same model's ``generate`` on torch CPU."""

import pytest
import torch

import torchtpu
from torchtpu import hf_generate

transformers = pytest.importorskip("transformers")

VOCAB = 128


@pytest.fixture(scope="module")
def models():
    cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    cpu = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    tpu = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu.to("tpu")


def _prompts(batch, length, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # row 0 left-padded, as a tokenizer with padding_side="left" makes it
    ids[0, :2] = 0
    return ids, mask


def _generate(model, ids, mask, **kw):
    dev = next(model.parameters()).device
    with torch.no_grad():
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), pad_token_id=0, **kw)
    return out.cpu()


def _compiles():
    return torchtpu.metrics.snapshot()["compiles"]


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_warm_generate_compiles_nothing_and_matches_cpu(models, cache):
    cpu, tpu = models
    kw = {} if cache == "dynamic" else {"cache_implementation": "static"}
    ids, mask = _prompts(3, 7, seed=1)
    fast = hf_generate.stats()["fast_calls"]
    before = _compiles()
    first = _generate(tpu, ids, mask, max_new_tokens=12, do_sample=False, **kw)
    assert hf_generate.stats()["fast_calls"] == fast + 1, hf_generate.stats()["last_reason"]
    # a first call: Hugging Face's set-up (fused: 3 programs), the prefill and decode forwards, the token choice
    assert _compiles() - before <= 8
    assert torch.equal(first, _generate(cpu, ids, mask, max_new_tokens=12, do_sample=False, **kw))
    # warm: other prompts, other numbers of new tokens (in the same cache bucket): nothing compiles
    for seed, n in ((2, 12), (3, 5), (4, 9)):
        ids, mask = _prompts(3, 7, seed=seed)
        before = _compiles()
        out = _generate(tpu, ids, mask, max_new_tokens=n, do_sample=False, **kw)
        assert _compiles() == before, f"{n} new tokens compiled {_compiles() - before}"
        assert out.shape == (3, 7 + n)
        assert torch.equal(out, _generate(cpu, ids, mask, max_new_tokens=n, do_sample=False, **kw))
    # a new prompt length in the same bucket: only Hugging Face's set-up at that length compiles (fused)
    ids, mask = _prompts(3, 9, seed=5)
    before = _compiles()
    out = _generate(tpu, ids, mask, max_new_tokens=6, do_sample=False, **kw)
    assert _compiles() - before <= 3
    assert torch.equal(out, _generate(cpu, ids, mask, max_new_tokens=6, do_sample=False, **kw))


def test_eos_stops_where_cpu_stops(models):
    cpu, tpu = models
    ids, mask = _prompts(3, 7, seed=5)
    ref = _generate(cpu, ids, mask, max_new_tokens=14, do_sample=False)
    eos = int(ref[1, 7 + 2])  # row 1 emits it at its third new token; row 0 may run on
    kw = dict(max_new_tokens=14, do_sample=False, eos_token_id=eos)
    want = _generate(cpu, ids, mask, **kw)
    got = _generate(tpu, ids, mask, **kw)
    assert torch.equal(got, want)
    assert (want[:, 7:] == 0).any() or want.shape[1] < 21  # the eos really stopped or padded a row


def test_sampling_warm_compiles_nothing(models):
    cpu, tpu = models
    ids, mask = _prompts(3, 7, seed=6)
    kw = dict(max_new_tokens=10, do_sample=True, temperature=0.8, top_k=20)
    _generate(tpu, ids, mask, **kw)
    before = _compiles()
    torch.manual_seed(0)
    a = _generate(tpu, ids, mask, **kw)
    torch.manual_seed(0)
    b = _generate(tpu, ids, mask, **kw)
    assert _compiles() == before
    assert torch.equal(a, b)  # tpu's random stream is seeded by torch.manual_seed
    assert a.shape == (3, 17) and torch.equal(a[:, :7], ids) and int(a.max()) < VOCAB
    # top_k=1 sampling is greedy decoding: exact against CPU's greedy output
    greedy = _generate(cpu, ids, mask, max_new_tokens=10, do_sample=False)
    assert torch.equal(_generate(tpu, ids, mask, max_new_tokens=10, do_sample=True, top_k=1), greedy)


def test_unsupported_options_run_hugging_faces_loop(models):
    cpu, tpu = models
    ids, mask = _prompts(3, 7, seed=7)
    hf = hf_generate.stats()["hf_calls"]
    with torch.no_grad():
        out = tpu.generate(input_ids=ids.to("tpu"), attention_mask=mask.to("tpu"), pad_token_id=0, max_new_tokens=2,
                           do_sample=False, return_dict_in_generate=True)
    assert hf_generate.stats()["hf_calls"] == hf + 1
    assert hf_generate.stats()["last_reason"] == "return_dict_in_generate"
    assert torch.equal(out.sequences.cpu(), _generate(cpu, ids, mask, max_new_tokens=2, do_sample=False))
