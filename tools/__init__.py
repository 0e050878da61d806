"""Offline tools that build the tiny models' assets (corpus, tokenizer, weights)."""
