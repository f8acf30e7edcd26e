"""Tiny transformers models built in fixtures: they generate in milliseconds on the CPU.

- `build_random_model`: a random dense Llama with a small byte-level BPE tokenizer.
- `build_random_moe_model`: a random Qwen3-MoE (8 experts, top-2) with the same tokenizer.
- `build_scripted_model`: a Llama whose weights make it follow a fixed token transition
  table (attention and MLP zeroed, one-hot embeddings, lm_head = transition matrix), so tests
  can force exact outputs: EOS, token stops, string stops, branching for n > 1.
- `build_chat_model`: a scripted model that answers one fixed reply to any chat and ends it with
  `<|im_end|>`, an EOS its generation_config.json declares that is not its tokenizer's EOS nor in
  its special-tokens map (as in Qwen-style checkpoints).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?:;-"
EOS = "<eos>"
IM_END = "<|im_end|>"  # id 71 in `build_chat_model`'s tokenizer: an added special token
IM_END_ID = 71


def _char_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {EOS: 0, **{c: i + 1 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=EOS)


def token_id(char: str) -> int:
    """The scripted/char tokenizer's id of one character (or of `EOS`, `IM_END`)."""
    if char == IM_END:
        return IM_END_ID
    return 0 if char == EOS else CHARS.index(char) + 1


VOCAB_SIZE = 72  # the characters and EOS (69), padded to an even size for RoPE


def _save(model, tokenizer, path: Path, eos_ids: Sequence[int]) -> Path:  # type: ignore[no-untyped-def]
    from transformers import GenerationConfig

    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    GenerationConfig(eos_token_id=list(eos_ids), bos_token_id=None, pad_token_id=0).save_pretrained(path)
    return path


def build_random_model(path: Path, *, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=0, bos_token_id=None, pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    # Wider logits than default init, so sampling is not uniform noise.
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return _save(model, _char_tokenizer(), path, [0])


def build_random_moe_model(
    path: Path, *, seed: int = 0, experts: int = 8, top_k: int = 2, layers: int = 2, eos_ids: Sequence[int] = (0,),
) -> Path:
    """A random Qwen3-MoE (all layers sparse) with the char tokenizer; routers scaled up so the
    top-k experts are well separated (no near-ties between the KV-cached and full forwards)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=experts, num_experts_per_tok=top_k, norm_topk_prob=True, max_position_embeddings=512,
        tie_word_embeddings=False, eos_token_id=list(eos_ids), bos_token_id=None, pad_token_id=0,
    )
    model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 1.0)
    return _save(model, _char_tokenizer(), path, eos_ids)


def build_scripted_model(
    path: Path, transitions: Mapping[str, str | Sequence[str]], *, eos_ids: Sequence[int] = (0,),
    strength: float = 12.0, tokenizer: Any = None, config_eos_ids: Sequence[int] | None = None,
) -> Path:
    """Greedy next token of char c is transitions[c] (equal odds when several are given).

    Characters with no entry go to EOS. `tokenizer`: the char tokenizer unless given; `config_eos_ids`:
    config.json's EOS ids where they differ from generation_config.json's (`eos_ids`).
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    v = VOCAB_SIZE
    config = LlamaConfig(
        vocab_size=v, hidden_size=v, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=1, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=list(eos_ids if config_eos_ids is None else config_eos_ids),
        bos_token_id=None, pad_token_id=0, rms_norm_eps=1e-6,
    )
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(v))
        model.model.norm.weight.fill_(1.0)
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        head = torch.zeros(v, v)
        for source in range(v):
            if source > len(CHARS):
                continue
            char = EOS if source == 0 else CHARS[source - 1]
            targets = transitions.get(char, EOS)
            targets = [targets] if isinstance(targets, str) else list(targets)
            for target in targets:
                head[token_id(target), source] = strength
        model.lm_head.weight.copy_(head)
    return _save(model, tokenizer or _char_tokenizer(), path, eos_ids)


CHAT_TEMPLATE = ("{% for m in messages %}{{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}:{% endif %}")


def build_chat_model(path: Path, reply: str) -> Path:
    """Answers `reply` then `IM_END` to any chat (its template ends the prompt with ":"); `reply`'s
    characters must differ from each other and from ":". config.json names only `<eos>` as EOS,
    generation_config.json `IM_END` too (SGLang stops on both)."""
    assert len(set(reply)) == len(reply) and ":" not in reply
    tokenizer = _char_tokenizer()
    tokenizer.add_tokens([IM_END], special_tokens=True)
    assert tokenizer.convert_tokens_to_ids(IM_END) == IM_END_ID
    tokenizer.chat_template = CHAT_TEMPLATE
    chain = ":" + reply
    transitions = {a: b for a, b in itertools.pairwise(chain)} | {reply[-1]: IM_END}
    return build_scripted_model(path, transitions, eos_ids=(0, IM_END_ID), config_eos_ids=(0,), tokenizer=tokenizer)
