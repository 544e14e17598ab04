"""The ``args`` a checkpoint carries for Megatron-LM (torch-free).

Megatron-LM's ``load_checkpoint`` reads ``state_dict["args"]`` (an
``argparse.Namespace``) from a checkpoint's common state: ``--use-checkpoint-args``
takes the model's shape from it, ``check_checkpoint_args`` compares it with the
command line, and the data position (``consumed_train_samples``) resumes from it.
These are the attributes of its ``megatron/training/arguments.py`` that our
architecture and run settings determine, under its names; a checkpoint written
here therefore continues under Megatron-LM's own ``pretrain_gpt.py``
(scripts/check_megatron_lm_gpu.py). What Megatron-LM would need beyond them (its
tokenizer, data, optimizer flags) has no counterpart in a snakellm run's model:
:data:`NOT_RECORDED` names them.
"""

from __future__ import annotations

from typing import Any

from snakellm.models.families.base import head_dim

# Megatron-LM flags a snakellm checkpoint's args leave to the command line (and why)
NOT_RECORDED = {
    "tokenizer_type / vocab_file / merge_file / tokenizer_model": "the run carries its tokenizer in RUN_DIR/tokenizer/, "
    "not as Megatron-LM tokenizer arguments (pass --tokenizer-type ..., or NullTokenizer with --vocab-size)",
    "data_path / split / data_cache_path": "the blend is the run's blend.json (data_prefix is Megatron's list)",
    "train_iters / lr_warmup_iters / lr_decay_iters / lr / min_lr ...": "recorded in opt_param_scheduler and the "
    "run config, not as flags; our scheduler counts iterations, Megatron-LM's counts samples",
    "use_distributed_optimizer / ckpt_fully_parallel_save": "our optimizer states are saved in model space "
    "(Float16OptimizerWithFloat16Params' layout) whether sharded or not",
    "transformer_impl": "the local layer spec (its keys) unless Transformer Engine ran: Megatron-LM must run "
    "with --transformer-impl local",
    "gradient_accumulation_fusion / masked_softmax_fusion / bias_*_fusion / apply_rope_fusion": "kernels, not state",
}


def megatron_lm_args(cfg: dict[str, Any], vocab: int, **run: Any) -> dict[str, Any]:
    """Megatron-LM argument names and values for a resolved architecture, a padded vocabulary and run facts
    (``tensor_model_parallel_size``, ``consumed_train_samples``, ``bf16`` ... passed through)."""
    heads, groups = cfg["num_attention_heads"], cfg["num_query_groups"]
    rope = cfg["position_embedding"] == "rope"
    out: dict[str, Any] = {
        "num_layers": cfg["num_layers"],
        "hidden_size": cfg["hidden_size"],
        "ffn_hidden_size": cfg["ffn_hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "group_query_attention": groups != heads,
        "kv_channels": head_dim(cfg),
        "seq_length": cfg["seq_length"],
        "max_position_embeddings": cfg["seq_length"],
        "position_embedding_type": "rope" if rope else "learned_absolute",
        "add_position_embedding": not rope,
        "use_rotary_position_embeddings": rope,
        "rotary_base": cfg["rotary_base"],
        "rotary_percent": 1.0,
        "rotary_interleaved": False,
        "use_rope_scaling": bool(cfg.get("rope_scaling_factor")),
        "rope_scaling_factor": cfg.get("rope_scaling_factor", 8.0),
        "normalization": cfg["normalization"],
        "norm_epsilon": cfg["layernorm_epsilon"],
        "apply_layernorm_1p": False,
        "swiglu": cfg["activation"] == "swiglu",
        "squared_relu": False,
        "add_bias_linear": bool(cfg["bias"]),
        "add_qkv_bias": bool(cfg.get("qkv_bias", cfg["bias"])),
        "qk_layernorm": bool(cfg.get("qk_norm")),
        "untie_embeddings_and_output_weights": not cfg["tie_embeddings"],
        "init_method_std": cfg["init_method_std"],
        "hidden_dropout": cfg["hidden_dropout"],
        "attention_dropout": cfg["attention_dropout"],
        "apply_query_key_layer_scaling": False,
        "make_vocab_size_divisible_by": cfg["make_vocab_size_divisible_by"],
        "padded_vocab_size": vocab,
        "ckpt_format": "torch_dist",
        "num_experts": None,
    }
    out.update(run)
    return out
