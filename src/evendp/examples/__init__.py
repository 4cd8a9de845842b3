"""Built-in examples: a char-level GPT and the Python standard library as its corpus."""
