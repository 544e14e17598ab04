"""Evaluation of base and fine-tuned models."""
