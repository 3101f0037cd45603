"""The rule of pro_adamw / ProAdamW (``precond._common.pro_adamw_recipe``): which
parameters are hidden weight matrices, on the names real codebases give them."""

from __future__ import annotations

import pytest

from precond._common.pro_adamw_recipe import is_hidden_matrix, torch_name_parts

# (a parameter's torch-style name, its number of dimensions, pro takes it).
CASES = [
    # The bench's char-lm (precond.bench.jax_models / torch_models).
    ("embedding", 2, False),
    ("position", 2, False),
    ("layers.0.attn_qkv", 2, True),
    ("layers.1.mlp_out", 2, True),
    ("layers.0.attn_qkv_bias", 1, False),
    ("layers.0.norm_1.scale", 1, False),
    ("head", 2, False),
    # nanoGPT / GPT-2.
    ("transformer.wte.weight", 2, False),
    ("transformer.wpe.weight", 2, False),
    ("transformer.h.3.attn.c_attn.weight", 2, True),
    ("transformer.h.3.mlp.c_proj.weight", 2, True),
    ("transformer.ln_f.weight", 1, False),
    ("lm_head.weight", 2, False),
    # Llama (Hugging Face, then Meta's reference).
    ("model.embed_tokens.weight", 2, False),
    ("model.layers.0.self_attn.q_proj.weight", 2, True),
    ("model.layers.0.mlp.down_proj.weight", 2, True),
    ("tok_embeddings.weight", 2, False),
    ("output.weight", 2, False),
    # BERT: "output" inside a block holds hidden matrices.
    ("bert.embeddings.word_embeddings.weight", 2, False),
    ("bert.embeddings.position_embeddings.weight", 2, False),
    ("bert.encoder.layer.0.attention.output.dense.weight", 2, True),
    ("bert.encoder.layer.0.output.dense.weight", 2, True),
    ("classifier.weight", 2, False),
    # flax: module names with a counter, camelCase not cut into words.
    ("Embed_0.embedding", 2, False),
    ("MultiHeadDotProductAttention_0.query.kernel", 3, True),
    ("Dense_0.kernel", 2, True),
    ("head.kernel", 2, False),
    ("logits.kernel", 2, False),
    # ViT / timm: the patch embedding is the input layer.
    ("patch_embed.proj.weight", 4, False),
    ("blocks.0.mlp.fc1.weight", 2, True),
    ("head.fc.weight", 2, False),
    # "pos" as a word of a hidden layer's module, away from the ends.
    ("layer_stack.0.pos_ffn.w_1.weight", 2, True),
    ("unembed.W_U", 2, False),
    # Convolutions are matrices once their dims are merged.
    ("conv_1", 4, True),
    ("scalar", 0, False),
]


@pytest.mark.parametrize(("name", "ndim", "hidden"), CASES, ids=[c[0] for c in CASES])
def test_the_rule_on_names_real_models_use(name, ndim, hidden):
    assert is_hidden_matrix(torch_name_parts(name), ndim) is hidden


def test_numbers_are_not_names():
    """A list index or layer number is skipped: the last two names of
    ``layers.0.w`` are ('layers', 'w'), so a head named 'output' is found one
    level above the index too."""
    assert is_hidden_matrix(["output", "0"], 2) is False
    assert is_hidden_matrix(["blocks", "0", "1"], 2) is True
    assert is_hidden_matrix([], 2) is True
