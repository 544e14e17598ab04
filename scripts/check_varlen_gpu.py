"""Check: ``examples.packed_attention: varlen`` (torch's flash variable-length attention) against SDPA in fp32 with
the dense block-diagonal mask, forward and backward, bf16, grouped-query heads, on one GPU.

Packed rows of SFT-shaped examples (``snakellm.finetune.dataset.pack``), their segment ids through
``snakellm.models.attention.varlen_packed`` (the path a fine-tune takes), with and without a softmax scale, and
once under ``torch.compile``. Prints the largest differences of the output and of each input's gradient beside
the gradients' magnitudes, and fails past the tolerances (bf16: 0.03 on the output, 2% of a gradient's
magnitude).

    python scripts/check_varlen_gpu.py            # one GPU, ~20 s
    python scripts/check_varlen_gpu.py --smoke    # CPU: the same path with the kernel's contract in SDPA
"""

from __future__ import annotations

import argparse
import random
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--width", type=int, default=1024, help="tokens a packed row")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8, help="key/value heads")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--examples", type=int, default=30)
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, a small shape, the kernel's contract in SDPA")
    a = p.parse_args(argv)
    import torch
    import torch.nn.functional as F

    from snakellm.finetune import dataset as ds
    from snakellm.models.attention import cu_seqlens_of, varlen_packed, varlen_reference

    if a.smoke:
        a.width, a.heads, a.groups, a.head_dim, a.examples = 64, 4, 2, 8, 12
    dev, dt = ("cpu", torch.float32) if a.smoke else ("cuda", torch.bfloat16)
    kernel = varlen_reference if a.smoke else None
    rng = random.Random(0)
    top = max(4, a.width // 4)
    exs = [
        ds.Example([rng.randrange(1, 999) for _ in range(rng.randint(3, top))], [1] * rng.randint(1, top // 3))
        for _ in range(a.examples)
    ]
    rows = ds.pack(exs, a.width, seed=1)
    seg = ds.collate_packed([[exs[i] for i in r] for r in rows], a.width, 0, answer_only_loss=True)["segment_ids"]
    seg = seg.to(dev)
    b, h, g, d, w = len(rows), a.heads, a.groups, a.head_dim, a.width
    torch.manual_seed(0)
    q = torch.randn(b, h, w, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, g, w, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, g, w, d, device=dev, dtype=dt, requires_grad=True)
    gy = torch.randn(w, b, h * d, device=dev, dtype=dt)
    segments = cu_seqlens_of(ds.packed_segments(seg)).numel() - 1
    print(f"{'CPU (the contract)' if a.smoke else torch.cuda.get_device_name()}: {b} rows of {w}, {segments} segments")
    out_tol, grad_tol = (1e-4, 1e-4) if a.smoke else (0.03, 0.02)
    ok = True
    for scale in (None, 0.07):
        mask = ~ds.packed_attention_mask(seg)
        ref = F.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), attn_mask=mask, scale=scale, enable_gqa=True
        )
        ref = ref.permute(2, 0, 1, 3).reshape(w, b, h * d)
        ref_grads = torch.autograd.grad(ref, (q, k, v), gy.float())
        out = varlen_packed(q, k, v, ds.packed_segments(seg), scale, attn=kernel)
        grads = torch.autograd.grad(out, (q, k, v), gy)
        out_err = (out.float() - ref).abs().max().item()
        errs = [(x.float() - y).abs().max().item() for x, y in zip(grads, ref_grads, strict=True)]
        mags = [y.abs().max().item() for y in ref_grads]
        good = out_err <= out_tol and all(e <= grad_tol * m for e, m in zip(errs, mags, strict=True))
        ok &= good
        print(
            f"scale {scale}: output max |diff| {out_err:.4f} (tolerance {out_tol}); gradients q/k/v max |diff| "
            + " / ".join(f"{e:.4f} of {m:.2f}" for e, m in zip(errs, mags, strict=True))
            + f" (tolerance {grad_tol:g} of each magnitude): {'ok' if good else 'FAIL'}"
        )
    if not a.smoke:
        f = torch.compile(lambda q, k, v: varlen_packed(q, k, v, ds.packed_segments(seg), None))
        err = (f(q, k, v).float() - varlen_packed(q, k, v, ds.packed_segments(seg), None).float()).abs().max().item()
        ok &= err == 0
        print(f"under torch.compile: max |diff| from eager {err} ({'ok' if err == 0 else 'FAIL'})")
    print("check:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
