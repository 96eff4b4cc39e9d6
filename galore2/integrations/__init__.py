"""Framework integrations: the Hugging Face Trainer (and accelerate, through it)."""
