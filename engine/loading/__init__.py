"""Reading a Hugging Face model folder: safetensors (bf16, FP8, int4), config, tokenizer."""
