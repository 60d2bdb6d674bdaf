"""TRL's GRPOTrainer unchanged on tpu: a tiny local Qwen2 and BPE tokenizer, a reward function, two
steps; generation goes through torchtpu.hf_generate, the loss and optimizer step run on tpu."""

import pytest
import torch

import torchtpu

transformers = pytest.importorskip("transformers")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["the answer is 12", "one plus two is three", "hello world"] * 5,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<pad>", "<s>", "</s>"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                pad_token="<pad>")


def test_grpo_trainer_runs_unchanged_on_tpu(tmp_path):
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ds = datasets.Dataset.from_dict({"prompt": ["the answer is", "one plus two", "hello", "two is"]})

    def reward(completions, **kw):
        return [len(c) / 10.0 for c in completions]

    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=2, learning_rate=1e-2, logging_steps=1,
                          report_to="none", seed=0, save_strategy="no")
    fast = torchtpu.hf_generate.stats()["fast_calls"]
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                              processing_class=_tokenizer())
    assert trainer.args.device.type == "tpu"
    trainer.train()
    assert torchtpu.hf_generate.stats()["fast_calls"] >= fast + 2  # each step generated on tpu at fixed shapes
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    after = trainer.model.state_dict()
    assert next(iter(after.values())).device.type == "tpu"
    assert any(not torch.equal(after[k].cpu(), v) for k, v in before.items())  # the optimizer stepped on tpu
    assert not torchtpu.metrics.snapshot()["cpu_fallbacks"]


def test_hf_trainer_sft_matches_cpu(tmp_path):
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   bos_token_id=1, eos_token_id=2, pad_token_id=0)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (8, 12), generator=g)
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    def run(use_cpu):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg)
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(use_cpu)), per_device_train_batch_size=4,
                                              max_steps=3, learning_rate=1e-2, logging_steps=1, report_to="none",
                                              seed=0, save_strategy="no", use_cpu=use_cpu, dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds)
        trainer.train()
        return trainer.args.device.type, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    cpu_dev, cpu_loss = run(True)
    tpu_dev, tpu_loss = run(False)
    assert (cpu_dev, tpu_dev) == ("cpu", "tpu")
    assert len(tpu_loss) == 3
    torch.testing.assert_close(torch.tensor(tpu_loss), torch.tensor(cpu_loss), rtol=1e-3, atol=1e-3)
