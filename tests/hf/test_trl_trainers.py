"""TRL's GRPOTrainer unchanged on tpu: a tiny local Qwen2 and BPE tokenizer, a reward function, two
steps; generation goes through torchtpu.hf_generate, the loss and optimizer step run on tpu. With
sampling made deterministic (top_k=1) the same run on CPU gives the same losses and weights (float32
and, under autocast, bfloat16)."""

import pytest
import torch

import torchtpu
from helpers import tiny_hf_causal_lm

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


@pytest.mark.parametrize("bf16", [False, True], ids=["float32", "bf16"])
def test_grpo_trainer_on_tpu_matches_cpu(tmp_path, bf16, metrics):
    # top_k=1: every completion is the greedy one, token-exact on tpu and CPU (tests/hf/test_hf_generate.py),
    # so the two runs see the same completions; the reward differs within each group (by its place in the
    # batch), so the advantages, the loss and the update are not zero. SGD: Adam's first steps are
    # lr * sign(grad), which turns rounding-level gradient differences on unused rows into lr-sized ones
    ds = datasets.Dataset.from_dict({"prompt": ["the answer is", "one plus two", "hello", "two is"]})

    def reward(completions, **kw):
        return [(i % 4) / 4 + len(c) / 100 for i, c in enumerate(completions)]

    def run(use_cpu):
        accelerate = pytest.importorskip("accelerate")
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        torch.manual_seed(0)
        # a config per run: training sets model.config.use_cache = False, so a shared config would leak it
        model = tiny_hf_causal_lm(num_layers=1, max_position_embeddings=128)
        args = trl.GRPOConfig(output_dir=str(tmp_path / str(use_cpu)), per_device_train_batch_size=4,
                              num_generations=4, max_completion_length=6, max_steps=2, learning_rate=0.1,
                              optim="sgd", logging_steps=1, report_to="none", seed=0, save_strategy="no", top_k=1,
                              use_cpu=use_cpu, bf16=bf16)
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                                  processing_class=_tokenizer())
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        weights = {k: v.detach().cpu().float() for k, v in trainer.model.state_dict().items()}
        accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
        return trainer.args.device.type, logs, weights

    cpu_dev, cpu_logs, cpu_w = run(True)
    fast = torchtpu.hf_generate.stats()["fast_calls"]
    tpu_dev, tpu_logs, tpu_w = run(False)
    assert (cpu_dev, tpu_dev) == ("cpu", "tpu")
    # each step generated on tpu at fixed shapes
    assert torchtpu.hf_generate.stats()["fast_calls"] >= fast + 2, torchtpu.hf_generate.stats()
    assert not metrics.snapshot()["cpu_fallbacks"]  # generation, loss and optimizer step all on tpu
    tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-4, atol=1e-4)
    for key in ("loss", "reward", "completions/mean_length", "grad_norm"):
        got, want = torch.tensor([h[key] for h in tpu_logs]), torch.tensor([h[key] for h in cpu_logs])
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{key}: {m}")
    assert any(h["grad_norm"] > 0 for h in cpu_logs)  # the update is real
    for k in cpu_w:
        torch.testing.assert_close(tpu_w[k], cpu_w[k], **tol)


def test_hf_trainer_sft_matches_cpu(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (8, 12), generator=g)
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    def run(use_cpu):
        torch.manual_seed(0)
        model = tiny_hf_causal_lm(num_layers=1, max_position_embeddings=64)
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
