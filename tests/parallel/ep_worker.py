"""One rank of the expert-parallel test:

python ep_worker.py MODEL_DIR RANK WORLD STORE_FILE OUT_FILE
"""

import sys

import ep_scenarios
import torch
import torch.distributed as dist

from engine.loading.loader import load_model
from engine.loading.tokenizer import Tokenizer
from engine.model import expert_parallel as parallel
from engine.model.config import ModelConfig

model_dir, rank, world, store, out = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    sys.argv[4],
    sys.argv[5],
)
# A file store: no port to pick, and no clash between tests run side by side.
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
try:
    experts = parallel.rank_experts(ModelConfig.from_dir(model_dir).num_experts)
    local = load_model(model_dir, dtype=torch.float32, experts=experts)
    results = ep_scenarios.run(
        local, Tokenizer.from_dir(model_dir), shard=lambda model: parallel.shard(model, experts)
    )
    torch.save({"experts": local.layers[0].w_gate_up.shape[0], **results}, out)
finally:
    dist.destroy_process_group()
