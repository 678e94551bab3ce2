"""Random-weight models of a named shape (`load_format="dummy"`): configs, seeded weights, finite logits,
the synthetic tokenizer, and the offline API on top of them. CPU only; the 8B shapes are checked on the meta
device (no memory), the SmolLM2-135M shape is built for real with a short context."""

from __future__ import annotations

import json
import math

import pytest
import torch

from stallfree.engine import LLM, SamplingParams
from stallfree.engine.model.dummy import (
    SHAPES,
    build_dummy_model,
    dummy_config,
    synthetic_tokenizer,
)
from stallfree.engine.model.llama import LlamaForCausalLM
from stallfree.engine.model.loader import load_model
from stallfree.engine.serve_cli import SHAPE_NAMES

MAX_LEN = 128

# Parameter counts of the real checkpoints these shapes copy (their model cards / safetensors indexes).
REAL_PARAMS = {
    "smollm2-135m": 134_515_008, "llama3-8b": 8_030_261_248, "mistral-7b": 7_241_732_096, "qwen3-8b": 8_190_735_360,
}  # fmt: skip


def hf_config(**overrides) -> dict:
    """A small Llama config.json as Hugging Face writes it."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
        "intermediate_size": 352, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 1000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    }  # fmt: skip
    return {**cfg, **overrides}


def greedy_logprobs(llm: LLM, prompt: list[int], n: int = 4):
    sp = SamplingParams(max_tokens=n, temperature=0.0, logprobs=5, ignore_eos=True)
    return llm.generate([prompt], sp, use_tqdm=False)[0]


@pytest.fixture(scope="module")
def smollm2():
    """The SmolLM2-135M shape in fp32 with seed 0 (0.5 GB, about 2 s on this box)."""
    torch.set_num_threads(1)
    return load_model("smollm2-135m", load_format="dummy", seed=0, max_model_len=MAX_LEN)


# ---- configs ---------------------------------------------------------------------------------------------
def test_the_cli_lists_every_shape():
    assert SHAPE_NAMES == tuple(SHAPES)  # serve_cli keeps a torch-free copy for --help


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_named_shape_gives_a_consistent_config(name):
    c = dummy_config(name)
    assert c.num_heads * c.head_dim == c.hidden_size
    assert c.num_heads % c.num_kv_heads == 0 and c.head_dim in (64, 128)
    assert c.vocab_size > c.eos_token_id and c.max_position_embeddings >= 8192
    with torch.device("meta"):  # the architecture at full size, without allocating its weights
        n = LlamaForCausalLM(c).num_params()
    if name in REAL_PARAMS:
        assert n == REAL_PARAMS[name]


def test_max_model_len_caps_the_rope_tables():
    assert dummy_config("llama3-8b", max_model_len=1024).max_position_embeddings == 1024
    assert dummy_config("smollm2-135m", max_model_len=10**6).max_position_embeddings == 8192


def test_a_config_json_file_or_its_folder(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_config()))
    by_file, by_folder = dummy_config(tmp_path / "config.json"), dummy_config(str(tmp_path))
    assert by_file == by_folder
    assert (by_file.hidden_size, by_file.num_layers, by_file.num_kv_heads, by_file.head_dim) == (
        128,
        2,
        2,
        32,
    )
    loaded = load_model(tmp_path / "config.json", load_format="dummy")
    assert loaded.name == f"dummy-{tmp_path.name}" and loaded.tokenizer.vocab_size == 1000
    assert load_model(tmp_path, load_format="dummy").name == f"dummy-{tmp_path.name}"


@pytest.mark.parametrize("spec", ["llama-8b", "/no/such/config.json"])
def test_a_bad_spec_names_the_shapes(spec):
    with pytest.raises(ValueError, match="smollm2-135m, llama3-8b, mistral-7b"):
        dummy_config(spec)
    with pytest.raises(ValueError, match="llama3-8b"):
        LLM(model=spec, load_format="dummy", device="cpu")


def test_a_broken_config_json_is_a_value_error(tmp_path):
    f = tmp_path / "config.json"
    f.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        dummy_config(f)
    cfg = hf_config()
    del cfg["hidden_size"]
    f.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        dummy_config(f)


def test_an_unknown_load_format_is_refused():
    with pytest.raises(ValueError, match="auto, dummy"):
        LLM(load_format="safetensors", device="cpu")


# ---- weights ---------------------------------------------------------------------------------------------
def test_weights_are_seeded(smollm2):
    cfg = smollm2.config
    same = build_dummy_model(cfg, torch.float32, "cpu", seed=0).state_dict()
    other = build_dummy_model(cfg, torch.float32, "cpu", seed=1).state_dict()
    mine = smollm2.model.state_dict()
    assert same.keys() == mine.keys()
    assert all(torch.equal(same[k], mine[k]) for k in mine)
    w = "model.layers.0.self_attn.o_proj.weight"
    assert not torch.equal(other[w], mine[w])
    assert not torch.equal(other["model.embed_tokens.weight"], mine["model.embed_tokens.weight"])


def test_weight_scale_keeps_the_residual_branches_small(smollm2):
    params = dict(smollm2.model.named_parameters())
    cfg = smollm2.config
    qkv = params["model.layers.3.self_attn.qkv_proj.weight"]
    down = params["model.layers.3.mlp.down_proj.weight"]
    assert qkv.std().item() == pytest.approx(1 / math.sqrt(cfg.hidden_size), rel=0.05)
    depth = 1 / math.sqrt(2 * cfg.num_layers)
    assert down.std().item() == pytest.approx(depth / math.sqrt(cfg.intermediate_size), rel=0.05)
    assert torch.all(params["model.norm.weight"] == 1)


# ---- logits and generation -------------------------------------------------------------------------------
def test_the_offline_api_generates_with_finite_logprobs_in_fp32(smollm2):
    llm = LLM(loaded_model=smollm2, device="cpu", dtype="float32", num_kv_blocks=32, max_num_seqs=4)
    out = greedy_logprobs(llm, list(range(100, 140)))
    assert len(out.token_ids) == 4
    for step in out.logprobs:
        vals = list(dict(step.top).values())
        assert all(math.isfinite(v) for v in vals)
        # O(1) logits over 49152 tokens: the top token is likely but nowhere near certain, nor uniform
        assert -math.log(49152) < max(vals) < -0.01


def test_load_format_dummy_through_llm_in_bf16():
    """The whole path from the constructor: model=None means the SmolLM2-135M shape, built in bf16."""
    llm = LLM(load_format="dummy", dtype="bfloat16", quantization="none", device="cpu", max_model_len=MAX_LEN,
              num_kv_blocks=32, max_num_seqs=4, seed=3)  # fmt: skip
    loaded = llm.engine.loaded
    assert loaded.name == "dummy-smollm2-135m" and loaded.config.max_position_embeddings == MAX_LEN
    assert next(loaded.model.parameters()).dtype == torch.bfloat16
    out = greedy_logprobs(llm, list(range(200, 230)))
    assert len(out.token_ids) == 4
    assert all(math.isfinite(v) for step in out.logprobs for v in dict(step.top).values())
    assert out.text.split() == [f"t{i}" for i in out.token_ids]  # words, continuing the prompt's text


def test_logits_stay_order_one_at_depth(tmp_path):
    """32 layers (the 8B's depth) at a small width, bf16: the 1/sqrt(2 * layers) scaling keeps logits O(1)."""
    (tmp_path / "config.json").write_text(json.dumps(hf_config(num_hidden_layers=32)))
    loaded = load_model(tmp_path, torch.bfloat16, load_format="dummy")
    llm = LLM(loaded_model=loaded, device="cpu", dtype="bfloat16", num_kv_blocks=16, max_num_seqs=2)
    out = greedy_logprobs(llm, list(range(10, 60)), n=2)
    top = [max(dict(step.top).values()) for step in out.logprobs]
    assert all(-math.log(loaded.config.vocab_size) < v < -0.01 for v in top), top


# ---- tokenizer -------------------------------------------------------------------------------------------
def test_the_synthetic_tokenizer_round_trips_ids():
    tok = synthetic_tokenizer(1000)
    ids = list(range(3, 1000, 7))
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids
    assert tok.decode([5, 6, 7]) == "t5 t6 t7"
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 1000)
    assert 2 in tok.stop_token_ids
