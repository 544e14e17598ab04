"""Fine-tuning: SFT data, LoRA / full SFT / p-tuning on megatron-core, adapters, evaluation metrics."""
