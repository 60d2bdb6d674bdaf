"""LoRA learners: peft adapters on a Hugging Face policy trained on tpu, adapter-only weight sync (through
the real object store) merged into a rollout worker's weights, the hf/ export (merged model for plain
transformers, the adapter for peft), and targets that match nothing."""

from __future__ import annotations

import functools

import pytest
import torch
from helpers import no_fallback, tiny_hf_causal_lm

from torchtpu.bucketing import BucketPolicy
from torchtpu_rl import Learner, RolloutEngine, SamplingParams
from torchtpu_rl.lora import LoraSpec, adapter_state_dict, save_lora_hf

pytest.importorskip("peft")

VOCAB = 96
BUCKETS = dict(prompt_buckets=BucketPolicy.pow2(8, 16), response_buckets=BucketPolicy.pow2(8, 8))
SPEC = LoraSpec(rank=4, alpha=8, targets=("q_proj", "v_proj"))
PROMPTS = [[5, 6, 7], [5, 6, 7], [9, 10], [9, 10]]


def _model(seed=0):
    return tiny_hf_causal_lm("qwen2", vocab_size=VOCAB, num_layers=1, seed=seed)


def test_targets_select_linear_layers_and_unknown_ones_are_named():
    model = _model()
    assert SPEC.target_layers(model) == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    assert "lm_head" not in LoraSpec(targets="all-linear").target_layers(model)
    assert len(LoraSpec(targets="all-linear").target_layers(model)) == 7
    with pytest.raises(ValueError, match=r"LoRA targets \['qproj'\] match no linear layer of Qwen2ForCausalLM; its "
                                         r"linear layers are named \['down_proj', 'gate_proj', 'k_proj', 'lm_head', "
                                         r"'o_proj', 'q_proj', 'up_proj', 'v_proj'\]"):
        LoraSpec(targets=("q_proj", "qproj")).target_layers(model)
    with pytest.raises(ValueError, match="rank must be a positive int"):
        LoraSpec(rank=0)


def test_lora_learner_trains_adapters_and_rollouts_merge_them(tmp_path):
    import peft
    import transformers

    policy = SPEC.apply(_model().to("tpu"))
    learner = Learner(policy, algo="grpo", group_size=2, lr=1e-2, compile=False)
    base_q = policy.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight.detach().cpu().clone()
    eng = RolloutEngine(_model(), 0, device="tpu", compile=False, lora=SPEC, **BUCKETS)
    full_bytes = sum(v.numel() * v.element_size() for v in _model().state_dict().values())
    with no_fallback():
        for step in range(2):
            batch = eng.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0))
            m = learner.train_step(batch, [1.0, 0.0, 0.5, 0.0])
            # the rollout merged the last adapters: its log-probs are the learner's
            assert m["rollout_logprob_diff_max"] < 1e-4
            adapters = adapter_state_dict(learner.policy)
            assert sorted(k.rsplit(".", 3)[-3] for k in adapters) == ["q_proj", "q_proj", "v_proj", "v_proj"]
            sync_bytes = sum(v.numel() * v.element_size() for v in adapters.values())
            assert sync_bytes < full_bytes / 20
            eng.update_weights(adapters, policy_version=step + 1)
    layer = policy.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.lora_B["default"].weight.detach().abs().max() > 0  # adapters trained ...
    torch.testing.assert_close(layer.base_layer.weight.detach().cpu(), base_q, rtol=0, atol=0)  # ... base frozen
    merged_q = eng.model.model.layers[0].self_attn.q_proj.weight.detach().cpu()
    assert not torch.equal(merged_q, base_q)
    with pytest.raises(ValueError, match="is not an adapter tensor"):
        eng.update_weights({"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, 32)})

    # hf/: the merged model for plain transformers, the adapter for peft
    save_lora_hf(learner.policy, None, tmp_path / "hf")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        want = learner.policy(ids.to("tpu")).logits.cpu()
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        torch.testing.assert_close(merged(ids).logits, want, rtol=1e-4, atol=1e-4)
        adapted = peft.PeftModel.from_pretrained(_model(), tmp_path / "hf" / "adapter")
        torch.testing.assert_close(adapted(ids).logits, want, rtol=1e-4, atol=1e-4)


def test_adapter_only_sync_through_the_object_store(ray_driver):
    from torchtpu_rl.workers import LearnerWorker, RolloutWorker

    learner = LearnerWorker(functools.partial(_model), learner_kwargs={"group_size": 2, "compile": False}, lora=SPEC)
    worker = RolloutWorker(_model, 0, engine_kwargs={"lora": SPEC, "compile": False, **BUCKETS})
    update = learner.publish_weights()
    assert sorted(s.name for s in update.plan.slots) == sorted(adapter_state_dict(learner.policy))
    assert learner.sender.last_timings["bytes"] == 4 * ((4 * 32 + 32 * 4) + (4 * 32 + 16 * 4))  # float32 A, B
    info = worker.update_weights(update)
    assert info["version"] == 0
    # a full-model update does not fit a LoRA worker: named
    plain = LearnerWorker(functools.partial(_model), learner_kwargs={"group_size": 2, "compile": False})
    with pytest.raises(ValueError, match="weight sync: tensor .* is not in the rollout worker 0's model"):
        worker.update_weights(plain.publish_weights())


def test_train_refuses_lora_targets_that_match_nothing(tmp_path):
    from torchtpu_rl import train

    tiny_hf_causal_lm("qwen2", vocab_size=VOCAB, num_layers=1).save_pretrained(tmp_path / "m")
    args = train.parse_args(["--model", str(tmp_path / "m"), "--data", "d", "--reward", "math_answer",
                             "--lora-rank", "4", "--lora-targets", "q_proj,attn_out"])
    from transformers import AutoConfig

    with pytest.raises(train.TrainError, match=r"LoRA targets \['attn_out'\] match no linear layer"):
        train._lora_spec(args, AutoConfig.from_pretrained(tmp_path / "m"))
    args.lora_targets = ["q_proj", "v_proj"]
    assert train._lora_spec(args, AutoConfig.from_pretrained(tmp_path / "m")).targets == ("q_proj", "v_proj")
    args.lora_modules_to_save = ["lm_head,embed"]
    with pytest.raises(train.TrainError, match="modules_to_save 'embed' matches no module"):
        train._lora_spec(args, AutoConfig.from_pretrained(tmp_path / "m"))
    args.lora_modules_to_save = ["lm_head"]
    assert train._lora_spec(args, AutoConfig.from_pretrained(tmp_path / "m")).modules_to_save == ("lm_head",)


def test_lora_with_the_output_layer_learns_a_task_full_fine_tuning_learns():
    """GRPO on a small tied-embedding Qwen2 (output logits ~0.1 at init), reward = the fraction of digit tokens
    (ids 10..19) in the response, 8 prompts x 8. LoRA of every linear layer but the output layer leaves such a
    model's output distribution where it was (nothing is lost: the learner's compiled update matches eager CPU,
    the rollouts' merged weights the learner; the frozen output layer limits it). With ``modules_to_save=
    ("lm_head",)`` (trained in full, untied from the frozen input embeddings, synced whole) the reward climbs
    from the base model's ~0.16 as in full fine-tuning, and the rollouts keep the learner's log-probs."""
    spec = LoraSpec(rank=8, alpha=16, targets=("all-linear",), modules_to_save=("lm_head",))

    def model():
        return tiny_hf_causal_lm("qwen2", vocab_size=64, num_layers=2, seed=0, tie_word_embeddings=True)

    eng = RolloutEngine(model(), 0, device="tpu", lora=spec, **BUCKETS)
    policy = spec.apply(model().to("tpu"))
    learner = Learner(policy, algo="grpo", group_size=8, lr=3e-2, kl_coef=0.001)
    emb = policy.base_model.model.model.embed_tokens.weight.detach().cpu().clone()
    prompts = [[3 + i, 4 + i, 5 + i] for i in range(8) for _ in range(8)]
    rewards = []
    for step in range(9):
        batch = eng.generate(prompts, SamplingParams(max_new_tokens=6, temperature=1.0))
        r = [float(((ids >= 10) & (ids < 20))[m.bool()].float().mean()) for ids, m in
             zip(batch.response_ids, batch.response_mask)]
        m = learner.train_step(batch, r)
        assert m["rollout_logprob_diff_max"] < 1e-3, (step, m["rollout_logprob_diff_max"])
        rewards.append(m["reward_mean"])
        eng.update_weights(adapter_state_dict(learner.policy), policy_version=step + 1)
    assert rewards[0] < 0.25 and sum(rewards[-2:]) / 2 > 0.5, rewards
    # the input embeddings stayed frozen on both sides; the rollout engine's output layer is its own tensor
    torch.testing.assert_close(policy.base_model.model.model.embed_tokens.weight.detach().cpu(), emb, rtol=0, atol=0)
    torch.testing.assert_close(eng.model.model.embed_tokens.weight.detach().cpu(), emb, rtol=0, atol=0)
    assert eng.model.lm_head.weight.data_ptr() != eng.model.model.embed_tokens.weight.data_ptr()


def test_lora_modules_to_save_export_and_errors(tmp_path):
    """hf/ of a LoRA + lm_head policy on a tied model: the merged model is saved untied and reloads in plain
    transformers to the learner's logits; a module name that matches nothing is named."""
    import transformers

    spec = LoraSpec(rank=4, alpha=8, targets=("q_proj",), modules_to_save=("lm_head",))
    policy = spec.apply(tiny_hf_causal_lm("qwen2", vocab_size=VOCAB, num_layers=1, tie_word_embeddings=True))
    with torch.no_grad():
        policy.base_model.model.lm_head.modules_to_save["default"].weight.add_(0.5)
    save_lora_hf(policy, None, tmp_path / "hf")
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
        torch.testing.assert_close(merged(ids).logits, policy(ids).logits, rtol=1e-5, atol=1e-5)
    assert not merged.config.tie_word_embeddings
    with pytest.raises(ValueError, match="modules_to_save 'head' matches no module of Qwen2ForCausalLM"):
        LoraSpec(modules_to_save=("head",)).apply(_model())
