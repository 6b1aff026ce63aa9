"""`wd-engine doctor`: one screen on this set-up (Python, wd-lsp, torch, the GPU, memory, Triton,
the hub, the engine daemon, the editor integrations, the models and their fit), run in a home
folder made for the test with the VS Code extension, a Neovim config and a Helix config in it,
and the GPU's memory faked."""

from __future__ import annotations

import platform

import torch
from hub_fake import isolated_env, wd_engine


def fields(text: str) -> dict[str, str]:
    """The screen's `NAME  value` lines, up to the models."""
    head = text.split("\nmodels:\n", 1)[0]
    return dict(line.split(maxsplit=1) for line in head.splitlines() if line.strip())


def test_doctor_says_what_a_new_user_needs_to_know(tmp_path):
    env = isolated_env(tmp_path, WD_ENGINE_GPU_MEMORY_GB="24", HF_TOKEN="hf_test")
    home = tmp_path / "home"
    (home / ".vscode" / "extensions" / "wd-lsp.wd-lsp-0.1.0").mkdir(parents=True)
    (home / ".config" / "nvim").mkdir(parents=True)
    (home / ".config" / "nvim" / "init.lua").write_text("require('wd_lsp').setup({})\n")
    (home / ".config" / "helix").mkdir(parents=True)
    (home / ".config" / "helix" / "languages.toml").write_text(
        '[language-server.wd-lsp]\ncommand = "wd-lsp"\n'
    )
    done = wd_engine(env, "doctor")
    assert done.returncode == 0, done.stderr
    found = fields(done.stdout)
    assert list(found) == [
        "Python",
        "wd-lsp",
        "torch",
        "GPU",
        "memory",
        "Triton",
        "hub",
        "daemon",
        "editors",
    ]
    assert found["Python"].startswith(platform.python_version())
    assert found["torch"].startswith(torch.__version__)
    assert found["GPU"] == "24.0 GB assumed (WD_ENGINE_GPU_MEMORY_GB)"
    assert " available), " in found["memory"] and found["memory"].endswith("CPU threads")
    assert found["hub"].startswith("huggingface_hub ")
    assert f"cache {tmp_path / 'hf' / 'hub'}" in found["hub"] and "token set" in found["hub"]
    assert found["daemon"].startswith("not running (an editor starts it")
    assert f"socket {tmp_path / 'run' / 'engine.sock'}" in found["daemon"]
    editors = found["editors"]
    assert "VS Code extension 0.1.0 in ~/.vscode/extensions/wd-lsp.wd-lsp-0.1.0" in editors
    assert "the plugin set up in ~/.config/nvim/init.lua" in editors
    assert "Helix: wd-lsp in ~/.config/helix/languages.toml" in editors
    models = done.stdout.split("\nmodels:\n", 1)[1].splitlines()
    assert models[0].split()[:2] == ["MODEL", "ARCHITECTURE"]
    assert models[1].split()[:2] == ["*", "wd-coder-small"] and "fits (" in models[1]
    assert len(done.stdout.splitlines()) < 30, "more than a screen"


def test_doctor_with_nothing_set_up(tmp_path):
    done = wd_engine(isolated_env(tmp_path), "doctor")
    assert done.returncode == 0, done.stderr
    found = fields(done.stdout)
    # An nvim on PATH is reported even without a config that sets up the plugin.
    editors = found["editors"]
    assert editors == "none set up (editors/README.md)" or editors.startswith("Neovim "), editors
    assert "no token (gated models need HF_TOKEN)" in found["hub"]
