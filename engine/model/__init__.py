"""The model: its config (config), how it computes (options), the decoder layer in torch (layer),
the model over its layers (qwen3_moe), the lean CPU forward of a few rows (lean_cpu, with its
weight forms in lean_matrices and its thread rule in cpu_threads) and the CUDA-graph decode step
(cuda_graph); random weights of a real shape (random_model) and expert parallelism
(expert_parallel)."""
