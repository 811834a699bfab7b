"""Integrations with other libraries (Hugging Face transformers).

Importing an integration registers its model adapter (`dsfn.adapters`): the transforms
reach a library's own loss and attention rules only through it.
"""
from dsfn.integrations import hf  # noqa: F401  (registers Hugging Face's adapter)
