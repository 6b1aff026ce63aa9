"""What this machine holds and can run: the models found locally (`catalog`), the machine's GPU
and memory (`machine`), whether a model fits (`fit`), the `wd-engine models` table (`report`),
the editor integrations installed (`editors`) and `wd-engine doctor` (`doctor`)."""
