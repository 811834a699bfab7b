"""Reference models used by dsfn's examples, tests and benchmarks."""
from dsfn.models.gpt import GPT, GPTConfig, generate, gpt_loss, greedy_generate

__all__ = ["GPT", "GPTConfig", "generate", "gpt_loss", "greedy_generate"]
