"""Small Llama models with seeded random weights, written where a real vLLM engine loads them.

vLLM's ``load_format="dummy"`` is useless for correctness (its outputs do not depend on the context),
so the weights are real safetensors drawn from a seeded generator: a different prefix changes the
output, and the same seed writes the same bytes on every machine. ``with_tokenizer`` adds a word-level
tokenizer built with the ``tokenizers`` library and a chat template, for ``vllm serve``."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

EOS = 2  # never sampled: tests ask for a fixed number of tokens with ignore_eos
SPECIALS = ["<unk>", "<s>", "</s>"]


@dataclass(frozen=True)
class TinyLlama:
    """A grouped-query-attention Llama; the defaults are the tests' model (17.6 M parameters)."""

    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab: int = 32000
    seed: int = 0
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token, as the engine's cache holds them."""
        return 2 * self.layers * self.kv_heads * self.head_dim * torch.empty((), dtype=self._dtype()).element_size()

    def _dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def config(self) -> dict:
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": self.hidden,
                "intermediate_size": self.intermediate, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "head_dim": self.head_dim, "num_hidden_layers": self.layers,
                "vocab_size": self.vocab, "max_position_embeddings": 16384, "rms_norm_eps": 1e-5,
                "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": self.dtype,
                "bos_token_id": 1, "eos_token_id": EOS}

    def weights(self) -> dict[str, torch.Tensor]:
        """Every tensor of the model, drawn in a fixed order from one seeded generator; scaled so that
        activations stay of order one through the layers (logits then depend on the whole context)."""
        gen = torch.Generator().manual_seed(self.seed)
        h, kv = self.hidden, self.kv_heads * self.head_dim

        def matrix(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=gen) * (gain / math.sqrt(cols))).to(self._dtype())

        out = {"model.embed_tokens.weight": matrix(self.vocab, h) * math.sqrt(h),
               "model.norm.weight": torch.ones(h, dtype=self._dtype()), "lm_head.weight": matrix(self.vocab, h)}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            # Sharp attention (q and k scaled up): each position attends to a few earlier tokens chosen by
            # content, so the output depends on the whole prefix rather than on its average.
            out |= {p + "self_attn.q_proj.weight": matrix(h, h, 2.5), p + "self_attn.k_proj.weight": matrix(kv, h, 2.5),
                    p + "self_attn.v_proj.weight": matrix(kv, h), p + "self_attn.o_proj.weight": matrix(h, h),
                    p + "mlp.gate_proj.weight": matrix(self.intermediate, h),
                    p + "mlp.up_proj.weight": matrix(self.intermediate, h),
                    p + "mlp.down_proj.weight": matrix(h, self.intermediate),
                    p + "input_layernorm.weight": torch.ones(h, dtype=self._dtype()),
                    p + "post_attention_layernorm.weight": torch.ones(h, dtype=self._dtype())}
        return out

    def write(self, directory: Path, with_tokenizer: bool = False) -> Path:
        """config.json and model.safetensors (and the tokenizer's files) in ``directory``; returns it."""
        from safetensors.torch import save_file  # vLLM's environment has it; the daemon's need not

        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.config(), indent=1))
        (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": EOS}))
        save_file({k: v.contiguous() for k, v in self.weights().items()}, str(directory / "model.safetensors"))
        if with_tokenizer:
            write_tokenizer(directory, self.vocab)
        return directory


CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} : {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant : {% endif %}")


def write_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over lowercase words and punctuation (``tokenizers``), its ids inside the
    model's vocabulary, with a chat template: enough for the OpenAI server to take chat requests."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders, normalizers

    fixed = SPECIALS + [":", ",", ".", "?", "!", "system", "user", "assistant"]
    words = fixed + [f"w{i}" for i in range(vocab_size - len(fixed))]
    vocab = {w: i for i, w in enumerate(words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "model_max_length": 16384, "chat_template": CHAT_TEMPLATE}))

