"""Sizing from the model: GPU count and pod memory from the weights and the KV cache; the spec overrides."""

from __future__ import annotations

import pytest
from test_builders import LLAMA_8B, make_ctx

from stallfree.operator.sizing import GIB, ModelShape, gpus_needed, parse_quantity, size

LLAMA_70B = ModelShape(
    weight_bytes=141_107_412_992, layers=80, kv_heads=8, head_dim=128, context_length=131072
)
HF = {"name": "m", "source": {"type": "HuggingFace", "uri": "hf://meta-llama/Llama-3.1-8B-Instruct"}}


def test_shape_from_a_hf_config():
    config = {
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_size": 4096,
        "head_dim": 128,
        "max_position_embeddings": 40960,
    }  # fmt: skip  (Qwen3-8B)
    shape = ModelShape.from_config(config, 16_381_470_720)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.context_length) == (36, 8, 128, 40960)
    assert shape.kv_bytes_per_token("bfloat16") == 2 * 36 * 8 * 128 * 2 == 147456
    assert shape.kv_bytes_per_token("float32") == 2 * 147456
    no_head_dim = ModelShape.from_config({**config, "head_dim": None, "num_key_value_heads": None}, 1)
    assert no_head_dim.head_dim == 128 and no_head_dim.kv_heads == 32  # hidden / heads; MHA
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelShape.from_config({"num_attention_heads": 1}, 1)


def test_quantities():
    assert parse_quantity("80Gi") == 80 * GIB and parse_quantity("1.5Ti") == int(1.5 * 1024 * GIB)
    assert parse_quantity("141G") == 141 * 10**9 and parse_quantity(1024) == 1024
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity("lots")


@pytest.mark.parametrize(
    ("shape", "max_len", "gpu_memory", "gpus"),
    [
        (LLAMA_8B, 8192, "80Gi", 1),  # 15 GiB of weights + 1 GiB of KV
        (LLAMA_8B, None, "24Gi", 2),  # the model's 128k context: 16 GiB of KV for one sequence
        (LLAMA_70B, 8192, "80Gi", 2),  # 131 GiB of weights
        (LLAMA_70B, None, "80Gi", 4),  # + 40 GiB of KV at 128k
        (LLAMA_70B, None, "24Gi", 8),  # does not fit a node: all of it (the engine then says so)
    ],
)
def test_gpu_count_holds_weights_and_one_full_length_sequence(shape, max_len, gpu_memory, gpus):
    s = size(shape, dtype="bfloat16", max_model_len=max_len, max_num_seqs=256, gpu_memory=gpu_memory,
             gpus_per_node=8, cpu_only=False, size_gpus=True, size_memory=True, fixed_gpus=1)  # fmt: skip
    assert s.gpus == gpus
    assert s.memory == f"{6 + 2 * gpus}Gi"  # streaming loader: host RAM does not scale with the weights
    length = max_len or shape.context_length
    assert s.kv_bytes_full == shape.kv_bytes_per_token("bfloat16") * length * 256


def test_power_of_two_and_node_cap():
    assert [gpus_needed(n * 70 * GIB, 80 * GIB, 8) for n in (1, 2, 3, 5, 20)] == [1, 2, 4, 8, 8]


def test_pipeline_stages_share_the_weights():
    s = size(LLAMA_70B, dtype="bfloat16", max_model_len=8192, max_num_seqs=1, gpu_memory="80Gi",
             gpus_per_node=8, cpu_only=False, size_gpus=True, size_memory=False, fixed_gpus=1, pipeline=2)  # fmt: skip
    assert s.gpus == 1 and s.memory is None


def test_cpu_pods_hold_the_weights_in_ram():
    s = size(LLAMA_8B, dtype="bfloat16", max_model_len=4096, max_num_seqs=8, gpu_memory="80Gi",
             gpus_per_node=8, cpu_only=True, size_gpus=True, size_memory=True, fixed_gpus=0)  # fmt: skip
    assert s.gpus is None
    need = LLAMA_8B.weight_bytes + 131072 * 4096 + 2 * GIB
    assert s.memory == f"{-(-need // GIB)}Gi" == "18Gi"


def test_the_spec_overrides_and_sizing_fills_only_what_is_unset():
    shape_70b = {"model": {**HF, "maxModelLen": 8192}}
    sized = make_ctx(shape_70b, shape=LLAMA_70B)
    assert sized.spec.parallelism.tensor == 2 and sized.spec.gpus_per_pod == 2
    assert sized.spec.resources.memory == "10Gi" and sized.sizing.gpus == 2
    pinned = make_ctx(
        {**shape_70b, "parallelism": {"tensor": 8}, "resources": {"memory": "64Gi"}}, shape=LLAMA_70B
    )
    assert pinned.spec.parallelism.tensor == 8 and pinned.spec.resources.memory == "64Gi"
    by_pod = make_ctx({**shape_70b, "resources": {"gpusPerPod": 1}}, shape=LLAMA_70B)
    assert by_pod.spec.parallelism.tensor == 1 and by_pod.spec.resources.memory == "8Gi"
    unknown = make_ctx(shape_70b, shape=None)  # the hub was not reachable: the plain defaults
    assert unknown.spec.parallelism.tensor == 1 and unknown.spec.resources.memory == "8Gi"
    assert unknown.sizing is None
