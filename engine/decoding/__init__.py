"""Choosing tokens: sampling, stops, token healing, beam search, speculative drafts."""
