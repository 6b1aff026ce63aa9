"""The model: its config, layer weights, the forward pass and the runners that execute it."""
