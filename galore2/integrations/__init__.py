"""Framework integrations (Hugging Face Trainer / accelerate) — built by the recipe issue."""
