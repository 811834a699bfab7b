"""Published model configurations (no weights): `preset_config(name)` gives the Hugging Face
config (built by `transformers.AutoConfig.for_model`) or dsfn `GPTConfig` of a model the
planner's at-scale table uses. The fields are the models' published `config.json` values."""
from __future__ import annotations

from typing import Any

from dsfn.errors import ConfigError

__all__ = ["PRESETS", "preset_config"]

_LLAMA = dict(model_type="llama", tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=8192)
PRESETS: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(_LLAMA, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0,
                      max_position_embeddings=4096),
    "llama3-8b": dict(_LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
    "llama3-70b": dict(_LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                       num_attention_heads=64, num_key_value_heads=8, vocab_size=128256),
    "llama3-405b": dict(_LLAMA, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
                        num_attention_heads=128, num_key_value_heads=8, vocab_size=128256),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-72b": dict(model_type="qwen2", hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    "qwen3-32b": dict(model_type="qwen3", hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                      num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                      tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32768, sliding_window=None,
                       tie_word_embeddings=False),
    "gemma2-9b": dict(model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                      num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
                      sliding_window=4096, tie_word_embeddings=True),
    "gemma2-27b": dict(model_type="gemma2", hidden_size=4608, intermediate_size=36864, num_hidden_layers=46,
                       num_attention_heads=32, num_key_value_heads=16, head_dim=128, vocab_size=256000,
                       sliding_window=4096, tie_word_embeddings=True),
    "mixtral-8x7b": dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, num_local_experts=8,
                         num_experts_per_tok=2, tie_word_embeddings=False),
    "mixtral-8x22b": dict(model_type="mixtral", hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                          num_attention_heads=48, num_key_value_heads=8, vocab_size=32768, num_local_experts=8,
                          num_experts_per_tok=2, tie_word_embeddings=False),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                          num_experts=128, num_experts_per_tok=8, vocab_size=151936, decoder_sparse_step=1,
                          mlp_only_layers=[], tie_word_embeddings=False),
    "qwen3-235b-a22b": dict(model_type="qwen3_moe", hidden_size=4096, intermediate_size=12288,
                            moe_intermediate_size=1536, num_hidden_layers=94, num_attention_heads=64,
                            num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                            vocab_size=151936, decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False),
    "deepseek-v3": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_routed_experts=256,
                        n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=3, q_lora_rank=1536,
                        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                        vocab_size=129280, n_group=8, topk_group=4, tie_word_embeddings=False),
    # GPT-2 layout (learned positions, GELU MLP 4h, tied head): dsfn's GPT
    "gpt3-175b": dict(model_type="dsfn-gpt", vocab_size=51200, seq_len=2048, n_layer=96, n_head=96, d_model=12288),
    "bloom-176b": dict(model_type="dsfn-gpt", vocab_size=250880, seq_len=2048, n_layer=70, n_head=112, d_model=14336),
}


def preset_config(name: str) -> Any:
    """The config of preset `name` (a `transformers` config, or a dsfn GPTConfig)."""
    if name not in PRESETS:
        raise ConfigError(f"plan: unknown model preset {name!r}; presets: {sorted(PRESETS)} (or pass a Hugging Face "
                          "config / dict with model_type)")
    fields = dict(PRESETS[name])
    mt = fields.pop("model_type")
    if mt == "dsfn-gpt":
        from dsfn.models.gpt import GPTConfig
        return GPTConfig(**fields)
    import transformers
    cfg = transformers.AutoConfig.for_model(mt, **fields)
    cfg._name_or_path = name
    return cfg
