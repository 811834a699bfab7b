"""Integrations with other libraries (Hugging Face transformers)."""
