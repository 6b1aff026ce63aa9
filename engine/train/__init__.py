"""Reproducible training pipeline for the embedded default model: corpus, tokenizer, model,
eval."""
