"""Model definitions, their checkpoints (Hugging Face folders, GGUF files) and loading them
(`loader.load_model`)."""
