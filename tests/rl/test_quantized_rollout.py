"""Quantized rollouts: a RolloutEngine generating with int8 / float8 weights on tpu, re-quantized from
the full-precision tensors of each weight update (also through a real object-store weight sync);
truncated importance sampling (token and sequence level) and its metrics in the learner; the
train entry point's flags."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import no_fallback, tiny_hf_causal_lm

import torchtpu
from torchtpu.bucketing import BucketPolicy
from torchtpu_rl import Learner, RolloutEngine, SamplingParams
from torchtpu_rl import algorithms as A

pytest.importorskip("torchao")

VOCAB = 96
PROMPTS = [[5, 17, 33, 8, 61, 9, 70], [44, 12, 90], [3, 3, 81, 27, 50], [66]]
BUCKETS = dict(prompt_buckets=BucketPolicy.pow2(8, 16), response_buckets=BucketPolicy.pow2(8, 8))
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def _model(seed=0):
    return tiny_hf_causal_lm("qwen2", vocab_size=VOCAB, num_layers=1, seed=seed)


@pytest.fixture(scope="module")
def float_engine():
    return RolloutEngine(_model(), 0, device="tpu", compile=False, **BUCKETS)


@pytest.mark.parametrize("quantization,compiled", [("int8", True), ("fp8", False)])
def test_quantized_engine_generates_and_requantizes_after_each_update(quantization, compiled, float_engine):
    float_engine.update_weights(_model().state_dict(), policy_version=0)
    eng = RolloutEngine(_model(), 0, device="tpu", compile=compiled, quantization=quantization, **BUCKETS)
    assert len(eng.quantized_layers) == 7 and "lm_head" not in eng.quantized_layers
    q_proj = eng.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.weight).__name__ == ("Int8Tensor" if quantization == "int8" else "Float8Tensor")
    with no_fallback(), warnings.catch_warnings():
        warnings.simplefilter("error", torchtpu.TPUFallbackWarning)  # no compiled graph run eagerly either
        batch = eng.generate(PROMPTS, GREEDY)
        ref = float_engine.generate(PROMPTS, GREEDY)
        # the quantized policy is close to the float one, not equal to it
        tol = 0.05 if quantization == "int8" else 0.15  # float8 e4m3 keeps 3 mantissa bits
        diff = (batch.logprobs - ref.logprobs).abs().max()
        assert 0 < diff < tol, diff
        new = _model(seed=1)
        old_q = q_proj.weight.qdata.cpu()
        compiles = torchtpu.metrics.snapshot()["compiles"]
        eng.update_weights(new.state_dict(), policy_version=1)
        again = eng.generate(PROMPTS, GREEDY)
        if compiled:  # the decode programs take the re-quantized weights as inputs: no recompile
            assert torchtpu.metrics.snapshot()["compiles"] == compiles
        float_engine.update_weights(new.state_dict(), policy_version=1)
        ref = float_engine.generate(PROMPTS, GREEDY)
    q_proj = eng.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.weight).__name__ in ("Int8Tensor", "Float8Tensor")
    assert not torch.equal(q_proj.weight.qdata.cpu(), old_q)
    assert again.policy_version.tolist() == [1] * len(PROMPTS)
    assert (again.logprobs - ref.logprobs).abs().max() < tol


def test_bad_quantization_is_refused():
    with pytest.raises(ValueError, match=r"quantization must be one of \['fp8', 'int8', 'int8_weight_only'\]"):
        RolloutEngine(_model(), 0, device="cpu", quantization="int4")


def test_truncated_importance_weights_token_and_sequence():
    behaviour = torch.log(torch.tensor([[0.5, 0.5, 0.2], [0.4, 0.1, 0.3]]))
    old = torch.log(torch.tensor([[0.5, 1.0, 0.9], [0.2, 0.1, 0.3]]))
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    tok = A.truncated_is_weights(behaviour, old, 2.0, mask, "token")
    torch.testing.assert_close(tok, torch.tensor([[1.0, 2.0, 0.0], [0.5, 1.0, 1.0]]))
    seq = A.truncated_is_weights(behaviour, old, 1.5, mask, "sequence")  # ratios 2.0 -> 1.5 and 0.5
    torch.testing.assert_close(seq, torch.tensor([[1.5, 1.5, 0.0], [0.5, 0.5, 0.5]]))
    ratio_mean, clipped, kl = A.rollout_mismatch_stats(behaviour, old, mask, 2.0, "token").tolist()
    assert ratio_mean == pytest.approx((1 + 2 + 0.5 + 1 + 1) / 5)
    assert clipped == 0.0  # 2.0 is at the threshold, not above it
    assert kl > 0
    ratio_mean, clipped, _ = A.rollout_mismatch_stats(behaviour, old, mask, 1.5, "sequence").tolist()
    assert ratio_mean == pytest.approx((2.0 + 0.5) / 2) and clipped == 0.5
    with pytest.raises(ValueError, match="level must be one of"):
        A.truncated_is_weights(behaviour, old, 2.0, mask, "batch")


def test_learner_logs_the_rollout_mismatch_of_a_quantized_rollout():
    eng = RolloutEngine(_model(), 0, device="tpu", compile=False, quantization="int8", **BUCKETS)
    eng.update_weights(_model().state_dict(), policy_version=0)
    batch = eng.generate([p for p in PROMPTS[:2] for _ in range(2)], SamplingParams(max_new_tokens=6, temperature=1.0))
    metrics = {}
    for level in ("token", "sequence"):  # (the learner's side runs the same on any device)
        learner = Learner(_model(), algo="grpo", group_size=2, lr=1e-3, tis_cap=2.0, tis_level=level, device="cpu")
        metrics[level] = learner.train_step(batch, [1.0, 0.0, 0.5, 0.0])
    for m in metrics.values():
        assert 0.5 < m["is_ratio_mean"] < 1.5 and 0.0 <= m["is_clipped_frac"] <= 1.0
        assert 0 < m["rollout_kl"] < 0.05  # the int8 rollout's numerics differ a little from the learner's
    with pytest.raises(ValueError, match="tis_level must be one of"):
        Learner(_model(), algo="grpo", group_size=2, tis_cap=2.0, tis_level="batch", device="cpu")


def test_rollout_worker_requantizes_what_a_weight_sync_sends(ray_driver):
    """The object-store sync of a LearnerWorker into a RolloutWorker with ``quantization="int8"`` (both
    in this process, the real Ray object store): the full-precision update matches the quantized
    model's state dict and is quantized on arrival."""
    import functools

    from torchtpu_rl.workers import LearnerWorker, RolloutWorker

    policy_fn = functools.partial(_model, seed=2)
    learner = LearnerWorker(policy_fn, learner_kwargs={"group_size": 2, "compile": False})
    worker = RolloutWorker(_model, 0, engine_kwargs={"quantization": "int8", "compile": False, **BUCKETS})
    update = learner.publish_weights()
    worker.update_weights(update)
    assert worker.version == 0
    q_proj = worker.engine.model.model.layers[0].self_attn.q_proj
    assert type(q_proj.weight).__name__ == "Int8Tensor"
    want = learner.policy.model.layers[0].self_attn.q_proj.weight.detach().cpu()
    got = q_proj.weight.dequantize().cpu()
    assert float((got - want).norm() / want.norm()) < 0.01  # the learner's weights, int8-quantized
    torch.testing.assert_close(worker.engine.model.lm_head.weight.cpu(), learner.policy.lm_head.weight.cpu())


def test_train_flags_for_quantized_rollouts():
    from torchtpu_rl import train

    def kwargs(*flags):
        args = train.parse_args(["--model", "m", "--data", "d", "--reward", "math_answer", *flags])
        return train._check_args(args).learner_kwargs()

    assert "tis_cap" not in kwargs()  # full-precision rollouts: no correction unless asked
    kw = kwargs("--rollout-quantization", "fp8")
    assert (kw["tis_cap"], kw["tis_level"]) == (2.0, "token")  # verl's defaults with quantized rollouts
    kw = kwargs("--rollout-quantization", "int8", "--rollout-is", "sequence", "--rollout-is-threshold", "3")
    assert (kw["tis_cap"], kw["tis_level"]) == (3.0, "sequence")
    assert "tis_cap" not in kwargs("--rollout-quantization", "int8", "--rollout-is", "none")
    with pytest.raises(train.TrainError, match="--rollout-is-threshold must be > 0"):
        train._check_args(train.parse_args(["--model", "m", "--data", "d", "--reward", "math_answer",
                                            "--rollout-is-threshold", "0"]))


def test_rollout_dtype_is_independent_of_the_learners(ray_driver):
    """A bfloat16 rollout worker fed by a float32 learner: the update is checked against float32 and
    cast on loading."""
    from torchtpu_rl import train
    from torchtpu_rl.workers import LearnerWorker, RolloutWorker

    learner = LearnerWorker(_model, learner_kwargs={"group_size": 2, "compile": False})
    worker = RolloutWorker(_model, 0, engine_kwargs={"dtype": "bfloat16", "compile": False, **BUCKETS})
    worker.update_weights(learner.publish_weights())
    engine = worker.engine
    assert {p.dtype for p in engine.model.parameters()} == {torch.bfloat16}
    want = learner.policy.model.layers[0].mlp.up_proj.weight.detach().cpu().to(torch.bfloat16)
    assert torch.equal(engine.model.model.layers[0].mlp.up_proj.weight.cpu(), want)
    batch = engine.generate(PROMPTS, GREEDY)
    assert batch.logprobs.dtype == torch.float32 and batch.response_ids.shape == (4, 6)
    args = train.parse_args(["--model", "m", "--data", "d", "--reward", "math_answer", "--rollout-dtype", "bfloat16"])
    assert args.dtype == "float32" and args.rollout_dtype == "bfloat16"
