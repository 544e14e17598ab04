"""LoRA adapters in Hugging Face PEFT format, for our exported Hugging Face base models.

``adapter_config.json`` + ``adapter_model.safetensors`` as ``peft`` writes them
(keys ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), with
the module names of the Hugging Face class our base is exported to:

* ``llama`` style -> ``LlamaForCausalLM``: ``linear_qkv`` becomes ``q_proj``,
  ``k_proj``, ``v_proj`` (one shared ``A``; ``B``'s rows taken out of
  megatron-core's per-query-group interleaving ``[q_g..., k_g, v_g]``),
  ``linear_proj`` -> ``o_proj``, ``linear_fc1`` -> ``gate_proj`` + ``up_proj``
  (its ``[gate; up]`` halves), ``linear_fc2`` -> ``down_proj``.
* ``gpt2`` style -> ``GPT2LMHeadModel``: ``linear_qkv`` -> ``attn.c_attn`` (rows
  reordered from per-head ``[q_h, k_h, v_h]`` to ``[q; k; v]``), ``linear_proj``
  -> ``attn.c_proj``, ``linear_fc1`` -> ``mlp.c_fc``, ``linear_fc2`` ->
  ``mlp.c_proj`` (``Conv1D`` modules: ``fan_in_fan_out`` true).

Modules trained whole beside the adapters (``modules_to_save``: the final
norm) go under their Hugging Face names (``transformer.ln_f`` / ``model.norm``),
as PEFT saves a ``ModulesToSaveWrapper``: ``base_model.model.<module>.weight``.

``r`` and ``lora_alpha`` carry over unchanged (PEFT's scale is alpha / r too),
so ``PeftModel.from_pretrained(hf_base, dir)`` computes what base + adapter
computes in megatron-core. Pure tensor work: no process group needed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_\w+)$")
# megatron-core module -> the Hugging Face module of each style (full paths: PEFT matches by suffix, and
# llama's "norm" alone would also catch every layer's input_layernorm)
_SAVED = {"decoder.final_layernorm": {"gpt2": "transformer.ln_f", "llama": "model.norm"}}


def _qkv_rows(arch: dict) -> tuple[list[int], list[int], list[int]]:
    """Row indices of q, k, v inside megatron-core's fused, group-interleaved qkv output."""
    nh, ng = arch["num_attention_heads"], arch["num_query_groups"]
    d = arch["hidden_size"] // nh
    per = nh // ng
    q, k, v = [], [], []
    for g in range(ng):
        base = g * (per + 2) * d
        q += list(range(base, base + per * d))
        k += list(range(base + per * d, base + (per + 1) * d))
        v += list(range(base + (per + 1) * d, base + (per + 2) * d))
    return q, k, v


def to_peft(tensors: dict[str, torch.Tensor], arch: dict, lora: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(PEFT state dict, adapter_config) from our gathered adapter tensors (lora.full_tensors)."""
    style = arch["style"]
    out: dict[str, torch.Tensor] = {}
    modules: list[str] = []

    def put(module: str, a: torch.Tensor, b: torch.Tensor) -> None:
        out[f"base_model.model.{module}.lora_A.weight"] = a.clone().contiguous()  # q/k/v share A: own copies
        out[f"base_model.model.{module}.lora_B.weight"] = b.contiguous()
        modules.append(module)

    saved: list[str] = []
    for key in sorted(k for k in tensors if not k.endswith((".lora_a", ".lora_b"))):
        module, pname = key.rsplit(".", 1)
        if module not in _SAVED:
            raise ValueError(f"adapter tensor {key!r}: not an adapter matrix nor a saved module")
        hf_module = _SAVED[module][style]
        out[f"base_model.model.{hf_module}.{pname}"] = tensors[key].contiguous()
        if hf_module not in saved:
            saved.append(hf_module)
    names = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith((".lora_a", ".lora_b"))})
    for name in names:
        m = _NAME.match(name)
        if not m:
            raise ValueError(f"adapter tensor {name!r}: not a transformer-layer linear")
        i, kind = int(m.group(1)), m.group(3)
        a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
        if style == "llama":
            pre = f"model.layers.{i}"
            if kind == "linear_qkv":
                q, k, v = _qkv_rows(arch)
                for proj, rows in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    put(f"{pre}.self_attn.{proj}", a, b[rows])
            elif kind == "linear_proj":
                put(f"{pre}.self_attn.o_proj", a, b)
            elif kind == "linear_fc1":
                gate, up = b.chunk(2, dim=0)
                put(f"{pre}.mlp.gate_proj", a, gate)
                put(f"{pre}.mlp.up_proj", a, up)
            else:
                put(f"{pre}.mlp.down_proj", a, b)
        else:
            pre = f"transformer.h.{i}"
            if kind == "linear_qkv":
                q, k, v = _qkv_rows(arch)
                put(f"{pre}.attn.c_attn", a, b[q + k + v])
            elif kind == "linear_proj":
                put(f"{pre}.attn.c_proj", a, b)
            elif kind == "linear_fc1":
                put(f"{pre}.mlp.c_fc", a, b)
            else:
                put(f"{pre}.mlp.c_proj", a, b)
    # the exact module names as one regex (PEFT full-matches a string target_modules): no suffix
    # ambiguity (gpt2's attn.c_proj / mlp.c_proj) and no layer-pattern guessing
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"] if lora.get("alpha") is not None else lora["rank"]),
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": "(" + "|".join(re.escape(m) for m in sorted(modules)) + ")",
        "fan_in_fan_out": style == "gpt2",
        "bias": "none",
        "inference_mode": True,
        "base_model_name_or_path": None,
        "modules_to_save": saved or None,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
    }
    return out, config


def write_peft(adapter_dir: str | Path, out_dir: str | Path) -> Path:
    """Read finetune's adapter/ and write PEFT's adapter_config.json + adapter_model.safetensors."""
    from safetensors.torch import load_file, save_file

    from snakellm.io.atomic import atomic_path, write_json

    src = Path(adapter_dir)
    conf = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter.safetensors"))
    sd, cfg = to_peft(tensors, conf["model"], conf["lora"])
    out = Path(out_dir)
    with atomic_path(out / "adapter_model.safetensors") as tmp:
        save_file(sd, str(tmp), metadata={"format": "pt"})
    write_json(out / "adapter_config.json", cfg)
    return out
