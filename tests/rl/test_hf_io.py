"""Hugging Face checkpoints in torchtpu_rl (torchtpu_rl.hf): policies of every family load on tpu and
match CPU, save_hf round-trips through plain transformers, the tokenizer's pad, reward models scored at
the last real token in bucketed batches, and directories of the wrong kind refused by name."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

import torchtpu
from helpers import HF_CAUSAL_LM_FAMILIES, tiny_hf_causal_lm
from torchtpu_rl import hf

IDS = torch.tensor([[1, 5, 9, 12, 7, 3, 30, 2], [1, 44, 8, 8, 21, 60, 17, 4]])


def _save_tokenizer(d, with_pad=True):
    """A small trained BPE tokenizer (ids below 64) saved into ``d``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the answer is 12", "one plus two is three", "hello world"] * 5,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<pad>", "<s>", "</s>"]))
    kw = {"pad_token": "<pad>"} if with_pad else {}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", **kw)
    fast.save_pretrained(d)
    return fast


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen2")
    tiny_hf_causal_lm("qwen2", num_layers=1, tie_word_embeddings=True).save_pretrained(d)
    _save_tokenizer(d, with_pad=False)
    return str(d)


@pytest.mark.parametrize("family", HF_CAUSAL_LM_FAMILIES)
def test_policy_of_each_family_loads_on_tpu_and_matches_cpu(family, tmp_path):
    ref = tiny_hf_causal_lm(family, num_layers=1, seed=1)
    ref.save_pretrained(tmp_path)
    policy = hf.load_policy(tmp_path)
    assert next(policy.parameters()).device.type == "tpu" and policy.training
    assert type(policy) is type(ref)
    with torch.no_grad():
        got = policy(IDS.to("tpu")).logits.cpu()
        want = ref(IDS).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_bfloat16_policy_reference_and_critic_from_one_directory(qwen_dir):
    policy = hf.load_policy(qwen_dir, dtype="bfloat16")
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}
    ref = hf.load_policy(qwen_dir, dtype="bfloat16")
    with torch.no_grad():
        a, b = policy(IDS.to("tpu")).logits.cpu(), ref(IDS.to("tpu")).logits.cpu()
    assert torch.equal(a, b) and a.dtype == torch.bfloat16
    critic = hf.load_critic(qwen_dir)
    values = critic(IDS.to("tpu"), attention_mask=torch.ones_like(IDS).to("tpu"))
    assert values.shape == IDS.shape and float(values.abs().max().cpu()) == 0.0  # the value head starts at zero
    with pytest.raises(ValueError, match="'float32' or 'bfloat16'"):
        hf.load_policy(qwen_dir, dtype="float16")


@pytest.mark.filterwarnings("ignore:tokenizer of .* has no pad token")
def test_save_hf_reloads_in_plain_transformers_to_the_same_logits(qwen_dir, tmp_path):
    """A policy trained on tpu (one AdamW step), saved with save_hf: transformers on CPU reloads it
    (safetensors, tied embeddings written once) to the same logits, with the tokenizer beside it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    policy = hf.load_policy(qwen_dir)
    tok = hf.load_tokenizer(qwen_dir)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-2)
    ids = IDS.to("tpu")
    policy(ids, labels=ids).loss.backward()
    opt.step()
    with torch.no_grad():
        trained = policy(ids).logits.cpu()
    out = tmp_path / "hf"
    hf.save_hf(policy, tok, out)
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out)  # plain transformers, CPU, float32
    with torch.no_grad():
        got = reloaded(IDS).logits
    torch.testing.assert_close(got, trained, rtol=1e-5, atol=1e-5)
    original = AutoModelForCausalLM.from_pretrained(qwen_dir)
    with torch.no_grad():
        assert (original(IDS).logits - got).abs().max() > 1e-3  # the saved weights are the trained ones
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert AutoTokenizer.from_pretrained(out).pad_token == "</s>"
    with pytest.raises(TypeError, match="PreTrainedModel"):
        hf.save_hf(torch.nn.Linear(2, 2), tok, tmp_path / "x")


def test_tokenizer_without_pad_gets_eos_with_one_warning(qwen_dir, tmp_path):
    hf._pad_warned.discard(qwen_dir)
    with pytest.warns(UserWarning, match="no pad token: using eos '</s>'"):
        tok = hf.load_tokenizer(qwen_dir)
    assert tok.pad_token == tok.eos_token == "</s>" and tok.pad_token_id == tok.eos_token_id
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = hf.load_tokenizer(qwen_dir)  # once per directory
    assert again.pad_token_id == tok.pad_token_id
    # a tokenizer trained with `tokenizers` keeps its own vocabulary (no class-default tokens added)
    assert len(tok) == len(tok.get_vocab()) <= 64
    d = tmp_path / "padded"
    d.mkdir()
    _save_tokenizer(d, with_pad=True)
    assert hf.load_tokenizer(d).pad_token == "<pad>"
    big = tiny_hf_causal_lm("qwen2", vocab_size=16, num_layers=1)
    with pytest.raises(ValueError, match="more than the model's vocab_size 16"):
        hf.check_tokenizer_fits(tok, big, qwen_dir)


def test_wrong_directories_are_refused_naming_what_they_hold(qwen_dir, tmp_path):
    from transformers import BertConfig, BertForMaskedLM, Qwen2Config, Qwen2ForSequenceClassification

    with pytest.raises(FileNotFoundError, match="does not exist"):
        hf.load_policy(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"no config.json \(found: \['notes.txt'\]\)"):
        hf.load_policy(tmp_path / "empty")
    bert = tmp_path / "bert"
    BertForMaskedLM(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                               intermediate_size=64)).save_pretrained(bert)
    with pytest.raises(ValueError, match=r"bert' is not a causal language model: it was saved as "
                                         r"\['BertForMaskedLM'\]"):
        hf.load_policy(bert)
    vit = tmp_path / "vit"
    vit.mkdir()
    (vit / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(ValueError, match=r"vit' is not a causal language model: its config has model_type 'vit'"):
        hf.load_policy(vit)
    cls_dir = tmp_path / "rm"
    Qwen2ForSequenceClassification(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               num_labels=1, pad_token_id=0)).save_pretrained(cls_dir)
    with pytest.raises(ValueError, match=r"rm.*not a causal language model.*Qwen2ForSequenceClassification"):
        hf.load_policy(cls_dir)
    with pytest.raises(ValueError, match=r"not a sequence-classification \(reward\) model.*Qwen2ForCausalLM"):
        hf.load_reward_model(qwen_dir)
    no_weights = tmp_path / "config_only"
    no_weights.mkdir()
    with open(os.path.join(qwen_dir, "config.json")) as f:
        (no_weights / "config.json").write_text(f.read())
    with pytest.raises(ValueError, match="cannot load the weights of .*config_only.*found: \\[.config.json.\\]"):
        hf.load_policy(no_weights)


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    d = tmp_path_factory.mktemp("reward")
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0,
                      max_position_embeddings=128)
    torch.manual_seed(3)
    Qwen2ForSequenceClassification(cfg).save_pretrained(d)
    _save_tokenizer(d, with_pad=True)
    return str(d)


def test_reward_model_scores_text_at_the_last_real_token_in_buckets(reward_dir, metrics):
    """The reward actor's model (AutoModelForSequenceClassification, one label) on tpu: each text's
    score equals transformers' own CPU score of that text alone; batches of 3 and 5 texts of
    different lengths share bucketed programs."""
    from transformers import AutoModelForSequenceClassification

    from torchtpu_rl.workers import RewardModelActor

    actor = RewardModelActor(model_dir=reward_dir)  # the actor class itself, in this process
    prompts = ["the answer is", "one plus two", "hello", "hello world", "one"]
    completions = [" 12", " is three", " world", "", " plus two is three hello world"]
    got = actor.score(prompts, completions, [{}] * 5)
    cpu = AutoModelForSequenceClassification.from_pretrained(reward_dir)
    want = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = actor.tokenizer(p + c, return_tensors="pt")["input_ids"]
            want.append(float(cpu(ids).logits[0, 0]))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-4)
    again = actor.score(prompts[:3], completions[:3], [{}] * 3)  # batch bucket 4
    assert again == pytest.approx(got[:3], abs=1e-5)
    third = actor.score(prompts[2:], completions[2:], [{}] * 3)
    assert third == pytest.approx(got[2:], abs=1e-5)
    # other texts of other raw lengths, same buckets: nothing new to compile
    n = torchtpu.metrics.snapshot()["compiles"]
    actor.score(prompts[1:4], completions[1:4], [{}] * 3)
    assert torchtpu.metrics.snapshot()["compiles"] == n
    assert set(torchtpu.metrics.snapshot()["compiles_by_bucket"]) >= {"batch=4,length=16", "batch=8,length=16"}
    with pytest.raises(TypeError, match="scores text"):
        actor.score([[1, 2]], [[3]], [{}])
