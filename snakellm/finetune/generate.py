"""Greedy generation on a megatron-core GPTModel (with whatever adapters are attached).

The interface evaluation needs: prompts as token ids in, generated ids out
(up to ``max_new_tokens``, stopping at EOD). Rows of a batch are right-padded;
under causal attention the logits at a row's last real position never see the
padding after it, so every row continues from its own length. No KV cache: the
whole prefix is recomputed each step, which is what small models and short
answers need; the serving engine of the artifacts issue replaces this for
large models.
"""

from __future__ import annotations

from collections.abc import Sequence


def greedy(
    model,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    max_length: int,
    batch_size: int = 16,
    device=None,
) -> list[list[int]]:
    import torch

    outs: list[list[int]] = []
    model.eval()
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            chunk = [list(p) for p in prompts[start : start + batch_size]]
            lens = [len(p) for p in chunk]
            width = min(max_length, max(lens) + max_new_tokens)
            buf = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            for r, p in enumerate(chunk):
                buf[r, : len(p)] = torch.tensor(p[:width])
            buf = buf.to(device) if device is not None else buf
            gen: list[list[int]] = [[] for _ in chunk]
            done = [ln >= width for ln in lens]
            cur = list(lens)
            for _ in range(max_new_tokens):
                if all(done):
                    break
                w = max(c for c, d in zip(cur, done, strict=False) if not d)
                pos = torch.arange(w, device=buf.device).unsqueeze(0).expand(len(chunk), w)
                logits = model(buf[:, :w], pos, None)  # [b, s, V] (megatron-core gathers TP shards)
                for r in range(len(chunk)):
                    if done[r]:
                        continue
                    nxt = int(logits[r, cur[r] - 1].float().argmax())
                    if nxt == eos_id:
                        done[r] = True
                        continue
                    gen[r].append(nxt)
                    buf[r, cur[r]] = nxt
                    cur[r] += 1
                    if cur[r] >= width or len(gen[r]) >= max_new_tokens:
                        done[r] = True
            outs.extend(gen)
    return outs
