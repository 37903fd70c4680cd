"""A tiny random Llama with a real (offline) word-level tokenizer and a ChatML chat template, for fast tests."""
import os
from typing import Optional

import torch

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant", "What", "is", "+", "-", "*", "?", "Give", "the", "answer", "\\", "boxed",
         "{", "}", ".", "think", "<", ">", "/", "#"] + [str(i) for i in range(100)]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_tokenizer(with_chat_template: bool = True, specials=SPECIALS, words=WORDS,
                        chat_template: str = CHAT_TEMPLATE):
    """A word-level tokenizer over `specials` + `words` (ids in that order), EOS <|im_end|>."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(specials + words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<|im_end|>")
    if with_chat_template:
        fast.chat_template = chat_template
    return fast


def make_tiny_model_dir(path: str, vocab_size: Optional[int] = None, with_chat_template: bool = True,
                        seed: int = 0) -> str:
    """Write a ~100k-parameter random Llama + tokenizer to `path` (loadable with from_pretrained).

    `vocab_size` (default: the tokenizer's size) may exceed the tokenizer, as real models pad their embeddings.

    Weights are drawn wider than the usual 0.02 so the output logits span a few units, as a trained model's do:
    with the final RMSNorm fixing the hidden-state scale, a 0.02 output layer keeps every distribution near uniform
    and no adapter could make any token likely.
    """
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = make_tiny_tokenizer(with_chat_template)
    vocab_size = vocab_size or len(tokenizer)
    if vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id, initializer_range=0.1,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_moe_model_dir(path: str, seed: int = 0) -> str:
    """A tiny random Mixtral (4 experts, 2 per token) with the tiny tokenizer: transformers holds its experts as
    fused tensors, which peft adapts as parameters, not as linear modules."""
    from transformers import MixtralConfig, MixtralForCausalLM

    tokenizer = make_tiny_tokenizer()
    config = MixtralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                           max_position_embeddings=256, tie_word_embeddings=False,
                           pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    MixtralForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_reward_model_dir(path: str, seed: int = 0) -> str:
    """Write a tiny random Llama sequence classifier (one output: a reward model) + tokenizer to `path`."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    tokenizer = make_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, initializer_range=0.5,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    LlamaForSequenceClassification(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_gemma2_model_dir(path: str, attention_cap: float = 50.0, seed: int = 0,
                               reward_model: bool = False) -> str:
    """A tiny random Gemma 2 (soft-capped attention logits and final logits, alternating sliding-window layers) with
    the tiny tokenizer; with `reward_model` a sequence classifier with one output instead of a causal LM. Its queries
    and keys are drawn large (q.k of several units) so that an `attention_cap` of a few units bends the attention
    logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma2ForSequenceClassification

    tokenizer = make_tiny_tokenizer()
    config = Gemma2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                          attn_logit_softcapping=attention_cap, final_logit_softcapping=30.0, sliding_window=8,
                          pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
                          num_labels=1)
    torch.manual_seed(seed)
    model = (Gemma2ForSequenceClassification if reward_model else Gemma2ForCausalLM)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(20)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
