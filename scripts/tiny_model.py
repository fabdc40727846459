"""Build a tiny random-weight Llama and a byte-level tokenizer, locally.

No model hub is reachable here, so every engine test and the demo use this
model. The output is deterministic (fixed seed) and the build is skipped when
the directory already holds a finished model of the same recipe.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

RECIPE_VERSION = "1"
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def build_tokenizer(out: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # 256 byte symbols plus three specials: every text encodes, nothing is <unk>.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {tok: i for i, tok in enumerate(["<unk>", "<s>", "</s>", *sorted(alphabet)])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        model_max_length=2048,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return len(vocab)


def build_model(out: Path, vocab_size: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head_dim 64: the CPU attention kernel rejects 16
        num_key_value_heads=2,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    out: Path = args.out
    marker = out / "tiny_model_recipe.json"
    if marker.exists() and json.loads(marker.read_text()).get("recipe") == RECIPE_VERSION:
        print(f"[tiny-model] up to date: {out}")
        return
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    vocab_size = build_tokenizer(tmp)
    build_model(tmp, vocab_size)
    (tmp / "tiny_model_recipe.json").write_text(json.dumps({"recipe": RECIPE_VERSION}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(f"[tiny-model] built {out}")


if __name__ == "__main__":
    main()
