"""p-tuning's prompt encoders (NeMo's MLP and LSTM) on a megatron-core model: the virtual tokens replace the
first N input embeddings, the base stays frozen, and gradient steps on the encoder alone lower the loss
(CPU, random tiny model)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from snakellm.finetune import runtime  # noqa: E402
from snakellm.models import architecture as models  # noqa: E402

VOCAB = 256


@pytest.fixture(scope="module")
def rt():
    r = runtime.start("cpu", 1, threads=1, seed=3)
    yield r
    runtime.stop()


@pytest.mark.parametrize("encoder", ["mlp", "lstm"])
def test_prompt_encoder_trains_alone_and_fills_the_first_positions(rt, encoder: str) -> None:
    from megatron.core import tensor_parallel

    from snakellm.finetune.ptuning import PTuning, PTuningConfig
    from snakellm.models.build import build_model

    arch = models.resolve("tiny", {"seq_length": 32})
    torch.manual_seed(1)
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    gpt, _ = build_model(arch, VOCAB, fused_loss="eager")
    for p in gpt.parameters():
        p.requires_grad_(False)
    frozen = {k: v.clone() for k, v in gpt.state_dict().items() if torch.is_tensor(v)}
    h = arch["hidden_size"]
    pt = PTuning(gpt, PTuningConfig(virtual_tokens=4, encoder=encoder, hidden=32, seed=5), h, torch.float32, rt.device)
    try:
        table = pt.virtual_embeddings()
        assert table.shape == (4, h) and torch.isfinite(table).all()
        if encoder == "lstm":
            assert any(n.startswith("lstm.") for n, _ in pt.encoder.named_parameters())
        # the hook: the word embeddings of positions 0..3 are the encoder's output, the rest untouched
        tokens = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
        emb = gpt.embedding.word_embeddings(tokens)
        assert torch.allclose(emb[:, :4], table.expand(2, 4, h)) and torch.equal(
            emb[:, 4:], frozen["embedding.word_embeddings.weight"][tokens[:, 4:]]
        )

        pos = torch.arange(12)[None].expand(2, 12)
        labels = torch.roll(tokens, -1, dims=1)

        def loss() -> torch.Tensor:
            return gpt(tokens, pos, None, labels=labels)[:, 4:].mean()

        opt = torch.optim.Adam(pt.encoder.parameters(), lr=1e-2)
        start = float(loss().detach())
        for _ in range(30):
            opt.zero_grad()
            value = loss()
            value.backward()
            opt.step()
        assert float(loss().detach()) < start - 0.05
        assert all(torch.equal(v, frozen[k]) for k, v in gpt.state_dict().items() if torch.is_tensor(v))
        assert not torch.allclose(pt.virtual_embeddings(), table)
    finally:
        pt.remove()
