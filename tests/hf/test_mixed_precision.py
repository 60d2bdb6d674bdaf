"""Mixed precision as Hugging Face and accelerate ask for it, on tpu: ``Trainer(bf16=True)`` and
``Accelerator(mixed_precision="bf16")`` pick the tpu, run the forward under ``torch.autocast("tpu",
bfloat16)`` (the matmuls' outputs are bfloat16, the master weights stay float32), and their losses equal
the same run under CPU autocast within bfloat16's tolerance, with no op falling back to CPU."""

import pytest
import torch

from helpers import no_fallback, tiny_hf_causal_lm

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
datasets = pytest.importorskip("datasets")

BF16_TOL = dict(rtol=1e-2, atol=1e-2)  # bfloat16 keeps 8 bits of mantissa


def _reset_accelerate():
    # accelerate's state is a process singleton: a run with use_cpu=True would pin the next one to CPU
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)


def test_hf_trainer_bf16_step_on_tpu_matches_cpu_autocast(tmp_path):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 64, (8, 12), generator=g)
    ds = datasets.Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    def run(use_cpu):
        _reset_accelerate()
        torch.manual_seed(0)
        model = tiny_hf_causal_lm(num_layers=1, max_position_embeddings=64)
        seen = []  # (output dtype of a linear layer, autocast on for the model's device)
        model.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda m, i, o: seen.append((o.dtype, torch.is_autocast_enabled(o.device.type))))
        args = transformers.TrainingArguments(output_dir=str(tmp_path / str(use_cpu)), per_device_train_batch_size=4,
                                              max_steps=2, learning_rate=1e-2, logging_steps=1, report_to="none",
                                              seed=0, save_strategy="no", use_cpu=use_cpu, dataloader_num_workers=0,
                                              bf16=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=ds)
        trainer.train()
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return trainer.args.device.type, losses, seen, {p.dtype for p in trainer.model.parameters()}

    cpu_dev, cpu_loss, _, _ = run(True)
    with no_fallback():
        tpu_dev, tpu_loss, seen, param_dtypes = run(False)
    _reset_accelerate()
    assert (cpu_dev, tpu_dev) == ("cpu", "tpu")
    assert seen and set(seen) == {(torch.bfloat16, True)}  # the forward ran under tpu autocast
    assert param_dtypes == {torch.float32}
    assert len(tpu_loss) == 2
    torch.testing.assert_close(torch.tensor(tpu_loss), torch.tensor(cpu_loss), **BF16_TOL)


def test_accelerate_bf16_step_on_tpu_matches_cpu_autocast():
    def run(cpu):
        _reset_accelerate()
        acc = accelerate.Accelerator(mixed_precision="bf16", cpu=cpu)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        seen = []
        model[0].register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = acc.prepare(model, opt)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(8, 16, generator=g).to(acc.device)
        y = torch.randint(0, 4, (8,), generator=g).to(acc.device)
        losses = []
        for _ in range(2):
            out = model(x)
            assert out.dtype == torch.float32  # accelerate converts the outputs back to float32
            loss = torch.nn.functional.cross_entropy(out, y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        weights = [p.detach().cpu() for p in model.parameters()]
        return acc.device.type, losses, seen, weights

    cpu_dev, cpu_loss, _, cpu_w = run(True)
    with no_fallback():
        tpu_dev, tpu_loss, seen, tpu_w = run(False)
    _reset_accelerate()
    assert (cpu_dev, tpu_dev) == ("cpu", "tpu")
    assert seen == [torch.bfloat16] * 2
    assert all(w.dtype == torch.float32 for w in tpu_w)
    torch.testing.assert_close(torch.tensor(tpu_loss), torch.tensor(cpu_loss), **BF16_TOL)
    for a, b in zip(tpu_w, cpu_w):
        torch.testing.assert_close(a, b, **BF16_TOL)
