"""p-tuning: N virtual tokens whose embeddings come from a small prompt encoder (NeMo's).

NeMo's ``PromptEncoder`` (``encoder_type: mlp | lstm``) turns a learned table of
``N`` vectors into the embeddings of ``N`` virtual tokens that precede every
prompt; the base model stays frozen. The MLP encoder is ``Linear(h, hidden) ->
ReLU -> Linear(hidden, h)`` applied to each vector (NeMo's ``num_layers: 2``);
the LSTM encoder is a bidirectional LSTM over the N vectors followed by the same
two-layer MLP from ``2 * hidden``. After training, only the N output embeddings
are needed (NeMo caches them as ``prompt_table``): :func:`virtual_embeddings`.

The virtual tokens are placeholder ids at the start of each sequence; a forward
hook on the word embedding replaces their embeddings (positions stay those of
the whole sequence, so learned and rotary positions both apply as usual).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

ENCODERS = ("mlp", "lstm")


@dataclass
class PTuningConfig:
    virtual_tokens: int = 10
    encoder: str = "mlp"
    hidden: int = 2048  # NeMo's encoder_hidden default
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.encoder not in ENCODERS:
            raise ValueError(f"p-tuning encoder {self.encoder!r}: choose from {', '.join(ENCODERS)}")
        if self.virtual_tokens < 1:
            raise ValueError(f"p-tuning virtual_tokens must be >= 1, got {self.virtual_tokens}")

    def as_dict(self) -> dict:
        return asdict(self)


class PromptEncoder(nn.Module):
    def __init__(self, cfg: PTuningConfig, hidden_size: int, init_std: float = 0.02):
        super().__init__()
        self.cfg = cfg
        g = torch.Generator().manual_seed(cfg.seed)
        self.embedding = nn.Parameter(torch.randn(cfg.virtual_tokens, hidden_size, generator=g) * init_std)
        mlp_in = hidden_size
        if cfg.encoder == "lstm":
            self.lstm = nn.LSTM(hidden_size, cfg.hidden // 2, num_layers=2, bidirectional=True, batch_first=True)
            mlp_in = cfg.hidden
            with torch.no_grad():
                for p in self.lstm.parameters():
                    p.copy_((torch.rand(p.shape, generator=g) * 2 - 1) / (cfg.hidden // 2) ** 0.5)
        self.fc1 = nn.Linear(mlp_in, cfg.hidden)
        self.fc2 = nn.Linear(cfg.hidden, hidden_size)
        with torch.no_grad():
            for lin in (self.fc1, self.fc2):
                bound = 1.0 / lin.in_features**0.5
                lin.weight.copy_((torch.rand(lin.weight.shape, generator=g) * 2 - 1) * bound)
                lin.bias.zero_()

    def forward(self) -> torch.Tensor:
        x = self.embedding
        if self.cfg.encoder == "lstm":
            x = self.lstm(x.unsqueeze(0))[0].squeeze(0)
        return self.fc2(torch.relu(self.fc1(x)))


class PTuning(nn.Module):
    """The prompt encoder plus the hook that puts its output at the first N positions."""

    def __init__(self, model, cfg: PTuningConfig, hidden_size: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.cfg = cfg
        self.encoder = PromptEncoder(cfg, hidden_size).to(device=device, dtype=dtype)
        self.table: torch.Tensor | None = None  # fixed embeddings (inference from a saved prompt table)
        emb = model.embedding.word_embeddings
        self._hook = emb.register_forward_hook(self._replace)

    def prompt(self) -> torch.Tensor:
        return self.table if self.table is not None else self.encoder()

    def _replace(self, module, args, output):
        # output [b, s, h] (word embeddings before the transpose to megatron's [s, b, h])
        n = self.cfg.virtual_tokens
        v = self.prompt().to(output.dtype)
        if output.dim() != 3 or output.size(1) < n:
            return output
        return torch.cat([v.unsqueeze(0).expand(output.size(0), n, v.size(-1)), output[:, n:]], dim=1)

    def remove(self) -> None:
        self._hook.remove()

    @torch.no_grad()
    def virtual_embeddings(self) -> torch.Tensor:
        return self.prompt().detach().float().cpu()
