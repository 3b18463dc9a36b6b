"""The CPU kernel's inference under a ``meta`` default device, for ``tests/test_redteam_round4.py`` (the kernel loads
in this process). ``python -m children.meta_device_inference``; prints the fused output's device, the scan flag's
device and the fused output's largest difference from naive's."""

import torch

from diffattn_tutorial.functional import diff_attention

if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 4, 5, 8, generator=g)
    v = torch.randn(1, 2, 5, 16, generator=g)
    ref = diff_attention(q, k, v, 0.5, backend="naive")
    with torch.device("meta"):
        fused = diff_attention(q, k, v, 0.5, backend="cpu_fused")
        flag = torch.ops.diffattn.cpu_fused_forward(q, k, v, torch.tensor(0.5, device="cpu"), None, False, 0.3,
                                                    scan=True)[2]
    print(fused.device, flag.device, float((fused - ref).abs().max()))
