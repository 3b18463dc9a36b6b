"""The 16-bit dtype and the SDPA kernels per device (``measure.gpu.preferred_half_dtype``, ``check_half_dtype``,
``sdpa_kernels_here``) and the training precision built on them (``train.half_dtype``, fp16 with a GradScaler),
checked without a GPU: the CUDA capability is faked with monkeypatch, and the GradScaler path runs on the CPU."""

from __future__ import annotations

import pytest
import torch

from diffattn_tutorial.measure import gpu
from diffattn_tutorial.training import loop

GPUS = {(7, 5): "Tesla T4", (8, 0): "NVIDIA A100-SXM4-40GB", (8, 6): "NVIDIA GeForce RTX 3090", (8, 9): "NVIDIA L4",
        (9, 0): "NVIDIA H100 80GB HBM3", (7, 0): "Tesla V100-SXM2-16GB"}


@pytest.fixture
def fake_gpu(monkeypatch):
    """``fake_gpu((7, 5))``: CUDA calls answer as that GPU would (no kernel runs)."""

    def install(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: GPUS[capability])
        return torch.device("cuda")

    return install


@pytest.mark.parametrize("capability,dtype", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                              ((8, 0), torch.bfloat16), ((8, 6), torch.bfloat16),
                                              ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_preferred_half_dtype_follows_the_compute_capability(fake_gpu, capability, dtype):
    device = fake_gpu(capability)
    assert gpu.preferred_half_dtype(device) == dtype
    assert gpu.preferred_half_dtype() == dtype  # the current CUDA device
    assert gpu.preferred_half_dtype("cpu") == torch.bfloat16


def test_bf16_on_a_t4_is_refused_naming_fp16(fake_gpu):
    device = fake_gpu((7, 5))
    with pytest.raises(ValueError, match=r"Tesla T4 \(compute capability 7\.5\).*use float16"):
        gpu.check_half_dtype(torch.bfloat16, device)
    gpu.check_half_dtype(torch.float16, device)  # fine
    gpu.check_half_dtype(torch.bfloat16, "cpu")  # a CPU has bf16 autocast
    gpu.check_half_dtype(torch.bfloat16, fake_gpu((8, 9)))


def test_sdpa_kernels_here_on_a_cpu():
    """The kernels that exist on this CPU take a plain call; those that exist only on CUDA say unavailable."""
    found = gpu.sdpa_kernels_here("cpu")
    assert set(found) == {"flash", "cudnn", "efficient", "math"}
    assert found["math"] == "ok" and found["flash"] == "ok"  # torch's fused CPU flash kernel
    assert found["efficient"].startswith("unavailable: ") and found["cudnn"].startswith("unavailable: ")


@pytest.mark.parametrize("capability,auto", [((7, 5), torch.float16), ((8, 0), torch.bfloat16),
                                             ((9, 0), torch.bfloat16)])
def test_train_precision_per_device(fake_gpu, capability, auto):
    device = fake_gpu(capability)
    assert loop.half_dtype("auto", device) == auto
    assert loop.half_dtype("fp32", device) is None
    assert loop.half_dtype("fp16", device) == torch.float16
    if capability < (8, 0):
        with pytest.raises(ValueError, match="use float16"):
            loop.half_dtype("bf16", device)
        with pytest.raises(ValueError, match="--strategy ddp"):  # a GradScaler's inf check over shards
            loop.half_dtype("auto", device, "fsdp2")
    else:
        assert loop.half_dtype("bf16", device) == torch.bfloat16
        assert loop.half_dtype("auto", device, "fsdp2") == torch.bfloat16
    assert loop.half_dtype("auto", torch.device("cpu")) is None
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        loop.half_dtype("fp16", torch.device("cpu"))


def test_fp16_trains_with_a_grad_scaler(tmp_path, monkeypatch):
    """The fp16 path end to end on the CPU (autocast fp16 and an enabled GradScaler, as a T4 would run it): the
    loss is scaled before the backward and the gradients unscaled before clipping, so the first step's gradient
    norm (same weights in both runs) is fp32's, not 256 times it; the loss stays finite."""
    scalers = []
    real = torch.amp.GradScaler

    def recording(device, enabled=True, **kw):  # a first scale that does not overflow this tiny model's fp16
        scalers.append(real(device, enabled=enabled, init_scale=256.0))  # gradients (2**16 does: a skipped step)
        return scalers[-1]

    common = ["--attention", "diff", "--d-model", "32", "--steps", "3", "--warmup", "1", "--lr", "0.01",
              "--global-batch", "4", "--batch-size", "4", "--no-progress"]
    assert loop.main([*common, "--out", str(tmp_path / "fp32")]) == 0
    monkeypatch.setattr(loop, "half_dtype", lambda precision, device, strategy="ddp": torch.float16)
    monkeypatch.setattr(torch.amp, "GradScaler", recording)
    assert loop.main([*common, "--out", str(tmp_path / "fp16")]) == 0
    assert len(scalers) == 1 and scalers[0].is_enabled() and scalers[0].get_scale() > 1
    from diffattn_tutorial.training.runlog import read_steps

    fp32, fp16 = (read_steps(tmp_path / run / "metrics.jsonl") for run in ("fp32", "fp16"))
    assert len(fp16) == 3 and all(torch.isfinite(torch.tensor(r["loss"])) for r in fp16)
    assert abs(fp16[0]["grad_norm"] / fp32[0]["grad_norm"] - 1) < 0.02, (fp16[0], fp32[0])
    assert abs(fp16[0]["loss"] / fp32[0]["loss"] - 1) < 1e-3
