"""Fill-in-the-middle prompts: the model's FIM format and fitting a context into a budget."""
