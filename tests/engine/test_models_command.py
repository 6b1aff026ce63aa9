"""`wd-engine models`: the models found (the embedded one, the hub cache's, the local model
folders') with their architecture, format, size, context, the default, and whether each fits the
GPU (the load check's own arithmetic, engine.loading.memory) and the CPU memory; the GPU's memory
faked through WD_ENGINE_GPU_MEMORY_GB (or --gpu-memory-gb), so the verdicts need no GPU."""

from __future__ import annotations

import json
import shutil

import pytest
from hub_fake import FakeHub, isolated_env, snapshot_path, wd_engine

from engine.loading import memory
from engine.model.config import ModelConfig

REPO = "Org/tiny-moe"
PARTIAL = "Org/half-there"


@pytest.fixture(scope="module")
def model_folder(checkpoint_factory):
    return checkpoint_factory(max_shard_size="300KB")


def gpu_bytes_needed(folder) -> int:
    """What the load check asks of a GPU for this folder: its weights as held on CUDA, a minimal
    KV cache in bf16 and the activations' reserve."""
    weights = memory.checkpoint_weight_bytes(folder, "auto", "cuda").total
    kv = memory.MIN_KV_TOKENS * memory.kv_bytes_per_token(ModelConfig.from_dir(folder), "bfloat16")
    return weights + kv + memory.RESERVE_BYTES


def test_models_lists_what_is_here_with_fit_verdicts(tmp_path, model_folder):
    with FakeHub() as hub:
        hub.add_repo(REPO, model_folder)
        hub.add_repo(PARTIAL, model_folder)
        env = isolated_env(tmp_path, hub.url)
        for repo in (REPO, PARTIAL):
            assert wd_engine(env, "pull", repo).returncode == 0
    shard = next(snapshot_path(tmp_path, hub, PARTIAL).glob("model-*.safetensors"))
    shard.unlink()
    models_dir = tmp_path / "models"
    shutil.copytree(model_folder, models_dir / "mine")
    (models_dir / "llama").mkdir()
    (models_dir / "llama" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    need = gpu_bytes_needed(model_folder)
    env.update(
        HF_HUB_OFFLINE="1",
        WD_ENGINE_MODEL_DIRS=str(models_dir),
        WD_LSP_MODEL=REPO,
        WD_ENGINE_GPU_MEMORY_GB=str((need + 10**6) / 1e9),  # a megabyte to spare
    )
    done = wd_engine(env, "models", "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["gpus"][0]["faked"] and report["gpus"][0]["total_bytes"] == need + 10**6
    models = {m["name"]: m for m in report["models"]}
    assert list(models) == ["wd-coder-small", "wd-coder-tiny", PARTIAL, REPO, "llama", "mine"]
    pulled = models[REPO]
    snap = snapshot_path(tmp_path, hub, REPO)
    assert pulled["path"] == str(snap) and pulled["source"] == "hub cache"
    assert pulled["architecture"] == "Qwen3MoeForCausalLM" and pulled["format"] == "fp32"
    assert pulled["context"] == 512 and pulled["problem"] is None
    assert pulled["size_bytes"] == sum(f.stat().st_size for f in model_folder.iterdir())
    assert pulled["gpu"] == {"fits": True, "needed_bytes": need, "why": None}
    assert pulled["cpu"]["fits"] is True
    # The default: what WD_LSP_MODEL names (a repo id here), not the embedded model.
    assert pulled["default"] and not models["wd-coder-small"]["default"]
    assert (
        models["wd-coder-small"]["format"] == "int4" and models["wd-coder-tiny"]["format"] == "fp8"
    )
    assert models["mine"]["source"] == "models folder" and models["mine"]["gpu"]["fits"]
    assert models[PARTIAL]["problem"] == (
        f"partly downloaded (missing {shard.name}): finish it with `wd-engine pull {PARTIAL}`"
    )
    assert models[PARTIAL]["gpu"]["fits"] is None
    assert models["llama"]["problem"] == "architecture LlamaForCausalLM unsupported"

    # A megabyte short: no, with what it needs and the GPU it was judged for.
    short = dict(env, WD_ENGINE_GPU_MEMORY_GB=str((need - 10**6) / 1e9))
    verdict = {
        m["name"]: m for m in json.loads(wd_engine(short, "models", "--json").stdout)["models"]
    }
    assert verdict[REPO]["gpu"]["fits"] is False
    assert verdict[REPO]["gpu"]["why"].startswith(f"{REPO} needs ")
    assert "assumed (WD_ENGINE_GPU_MEMORY_GB)" in verdict[REPO]["gpu"]["why"]
    # --gpu-memory-gb wins over the variable.
    flag = json.loads(wd_engine(short, "models", "--json", "--gpu-memory-gb", "80").stdout)
    assert {m["name"]: m["gpu"]["fits"] for m in flag["models"]}[REPO] is True

    # The table: one row a model, the default starred, then why the misfits do not fit.
    text = wd_engine(short, "models").stdout.splitlines()
    assert text[0] == f"GPU: {(need - 10**6) / 1e9:.1f} GB assumed (WD_ENGINE_GPU_MEMORY_GB)"
    assert text[1].startswith("CPU memory: ")
    header = text[3].split()
    assert header == ["MODEL", "ARCHITECTURE", "FORMAT", "SIZE", "CONTEXT", "GPU", "CPU", "SOURCE"]
    row = next(line for line in text if f" {REPO} " in line)
    assert row.startswith("*") and row.split()[1:6] == [
        REPO,
        "Qwen3MoeForCausalLM",
        "fp32",
        *row.split()[4:6],
    ]
    assert f"no ({need / 1e9:.1f} GB)" in row and row.rstrip().endswith("hub cache")
    assert any(line.startswith("* the default: $WD_LSP_MODEL") for line in text)
    assert f"GPU: {verdict[REPO]['gpu']['why']}" in text
    assert f"{PARTIAL}: {models[PARTIAL]['problem']}" in text


def test_a_bad_gpu_memory_override_is_refused(tmp_path):
    done = wd_engine(isolated_env(tmp_path, WD_ENGINE_GPU_MEMORY_GB="lots"), "models")
    assert done.returncode == 2
    assert "WD_ENGINE_GPU_MEMORY_GB must be a number of GB, got 'lots'" in done.stderr
