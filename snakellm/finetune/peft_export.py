"""LoRA adapters in Hugging Face PEFT format, for our exported Hugging Face base models.

``adapter_config.json`` + ``adapter_model.safetensors`` as ``peft`` writes them
(keys ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), with
the module names of the Hugging Face class our base is exported to. Both come
from the family's weight table (``snakellm/models/families/<style>.py``): the
HF module(s) a megatron-core linear becomes, and how its output rows split. A
LoRA ``B`` (one row per output) is split like the weight it adapts; ``A`` is
shared by every part. For example ``llama``'s ``linear_qkv`` becomes ``q_proj``,
``k_proj``, ``v_proj`` (``B``'s rows taken out of megatron-core's per-query-group
interleaving ``[q_g..., k_g, v_g]``) and ``linear_fc1`` becomes ``gate_proj`` +
``up_proj``; ``gpt2``'s ``linear_qkv`` becomes ``attn.c_attn`` (rows reordered to
``[q; k; v]``), a ``Conv1D``: ``fan_in_fan_out`` true.

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

from snakellm.finetune.lora import MODULES_TO_SAVE
from snakellm.models import families
from snakellm.models.families.base import ROWS, Sizes

_NAME = re.compile(r"^decoder\.layers\.(\d+)\.(self_attention|mlp)\.(linear_\w+)$")


def _saved_modules(tensors: dict[str, torch.Tensor], family: families.Family) -> tuple[dict, list[str]]:
    """PEFT's ``modules_to_save`` tensors under their HF names, and those names."""
    out: dict[str, torch.Tensor] = {}
    saved: list[str] = []
    for key in sorted(k for k in tensors if not k.endswith((".lora_a", ".lora_b"))):
        module, pname = key.rsplit(".", 1)
        if module not in MODULES_TO_SAVE.values():
            raise ValueError(f"adapter tensor {key!r}: not an adapter matrix nor a saved module")
        # the full HF path (PEFT matches by suffix: llama's "norm" alone would catch every input_layernorm)
        hf_module = family.hf_module(module)
        out[f"base_model.model.{hf_module}.{pname}"] = tensors[key].contiguous()
        if hf_module not in saved:
            saved.append(hf_module)
    return out, saved


def to_peft(tensors: dict[str, torch.Tensor], arch: dict, lora: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """(PEFT state dict, adapter_config) from our gathered adapter tensors (lora.full_tensors)."""
    family = families.for_arch(arch)
    sizes = Sizes(arch, 0, 0)
    out, saved = _saved_modules(tensors, family)
    modules: list[str] = []
    names = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith((".lora_a", ".lora_b"))})
    for name in names:
        if not _NAME.match(name):
            raise ValueError(f"adapter tensor {name!r}: not a transformer-layer linear")
        a, b = tensors[f"{name}.lora_a"], tensors[f"{name}.lora_b"]
        hf_modules, rows = family.peft_modules(name)
        for module, part in zip(hf_modules, ROWS[rows].split(b, sizes), strict=True):
            out[f"base_model.model.{module}.lora_A.weight"] = a.clone().contiguous()  # parts share A: own copies
            out[f"base_model.model.{module}.lora_B.weight"] = part.contiguous()
            modules.append(module)
    # the exact module names as one regex (PEFT full-matches a string target_modules): no suffix
    # ambiguity (gpt2's attn.c_proj / mlp.c_proj) and no layer-pattern guessing
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(lora["rank"]),
        "lora_alpha": float(lora["alpha"] if lora.get("alpha") is not None else lora["rank"]),
        "lora_dropout": float(lora.get("dropout", 0.0)),
        "target_modules": "(" + "|".join(re.escape(m) for m in sorted(modules)) + ")",
        "fan_in_fan_out": family.fan_in_fan_out,
        "bias": "none",
        "inference_mode": True,
        "base_model_name_or_path": None,
        "modules_to_save": saved or None,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
    }
    return out, config


def _write(out: Path, sd: dict[str, torch.Tensor], cfg: dict) -> Path:
    """adapter_model.safetensors, then adapter_config.json (the file a rule waits for), each atomically."""
    from safetensors.torch import save_file

    from snakellm.io.atomic import atomic_path, write_json

    with atomic_path(out / "adapter_model.safetensors") as tmp:
        save_file(sd, str(tmp), metadata={"format": "pt"})
    write_json(out / "adapter_config.json", cfg)
    return out


def write_peft(adapter_dir: str | Path, out_dir: str | Path, base_model: str) -> Path:
    """Read finetune's adapter/ and write PEFT's adapter_config.json + adapter_model.safetensors.

    ``base_model`` goes to ``base_model_name_or_path``: the Hugging Face directory (or hub name) of the
    base, which ``AutoPeftModelForCausalLM.from_pretrained(out_dir)`` loads the adapter onto.
    """
    from safetensors.torch import load_file

    src = Path(adapter_dir)
    conf = json.loads((src / "adapter_config.json").read_text())
    tensors = load_file(str(src / "adapter.safetensors"))
    sd, cfg = to_peft(tensors, conf["model"], conf["lora"])
    cfg["base_model_name_or_path"] = base_model
    out = _write(Path(out_dir), sd, cfg)
    copy_tokenizer(Path(base_model), out, (conf.get("tokenizer") or {}).get("chat_template"))
    return out


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "chat_template.jinja")  # fmt: skip


def copy_tokenizer(base_dir: Path, out: Path, chat_template: str | None) -> None:
    """The base export's tokenizer files beside the adapter (as PEFT's save_pretrained of a tokenizer leaves
    them), with the chat template the fine-tune trained with in tokenizer_config.json."""
    import shutil

    from snakellm.io.atomic import write_json

    if not base_dir.is_dir():
        return  # a hub name: the tokenizer is the hub's
    for name in TOKENIZER_FILES:
        if (base_dir / name).is_file() and not (name == "chat_template.jinja" and chat_template):
            shutil.copyfile(base_dir / name, out / name)
    if chat_template and (out / "tokenizer_config.json").is_file():
        cfg = json.loads((out / "tokenizer_config.json").read_text(encoding="utf-8"))
        write_json(out / "tokenizer_config.json", {**cfg, "chat_template": chat_template})


def write_prompt_tuning(prompt_dir: str | Path, out_dir: str | Path, base_model: str) -> Path:
    """A p-tuning prompt table in PEFT's prompt-tuning format (``peft_type: PROMPT_TUNING``).

    What NeMo keeps of a p-tuning run for inference is its ``prompt_table``: the prompt encoder's
    output, one embedding per virtual token, put in front of each prompt's token embeddings. PEFT's
    prompt tuning is exactly that table (``prompt_embeddings`` [virtual tokens, hidden], in front of
    the input embeddings, positions counted from the first virtual token, as ours), so
    ``PeftModel.from_pretrained(hf_base, out_dir)`` computes what our model with the table computes.
    """
    from safetensors.torch import load_file

    src = Path(prompt_dir)
    conf = json.loads((src / "prompt_config.json").read_text())
    table = load_file(str(src / "virtual_tokens.safetensors"))["prompt_table"]
    arch = conf["model"]
    cfg = {
        "peft_type": "PROMPT_TUNING",
        "task_type": "CAUSAL_LM",
        "num_virtual_tokens": int(table.shape[0]),
        "token_dim": int(table.shape[1]),
        "num_transformer_submodules": 1,
        "num_attention_heads": int(arch["num_attention_heads"]),
        "num_layers": int(arch["num_layers"]),
        "prompt_tuning_init": "RANDOM",
        "prompt_tuning_init_text": None,
        "tokenizer_name_or_path": None,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    return _write(Path(out_dir), {"prompt_embeddings": table.float().contiguous()}, cfg)
