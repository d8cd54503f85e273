"""Token experience for LLM RL: ragged sequences, prompt groups, token-balanced delivery."""
