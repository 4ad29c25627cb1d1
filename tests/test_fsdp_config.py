"""transformers' `fsdp` / `fsdp_config` fields (transformers 5's form is `fsdp: true` tuned by `fsdp_config`; the older
form is strategy words): read as TrainingArguments._process_fsdp_args reads them, mapped onto groupwise's FSDP2
(groupwise.sharding.Sharding). The two-process run with them is in test_fsdp.py."""

from __future__ import annotations

import json

import pytest

from groupwise import ConfigError, GRPOConfig
from groupwise.sharding import Sharding, resolve


@pytest.mark.parametrize("fsdp, config, expected", [
    (True, None, Sharding(True)),  # transformers 5: fsdp=True, FSDP2, reshard after forward by default
    (True, {"reshard_after_forward": False}, Sharding(False)),
    (True, {"fsdp_reshard_after_forward": "false"}, Sharding(False)),  # the accelerate-style prefix is dropped
    ("full_shard auto_wrap", None, Sharding(True)),
    ("auto_wrap", None, Sharding(True)),  # no strategy word: transformers' default (full shard)
    (["shard_grad_op"], None, Sharding(False)),  # a list, as TrainingArguments takes it
    # the config's reshard_after_forward wins over the strategy word (transformers: setdefault from the word)
    ("shard_grad_op", {"reshard_after_forward": True}, Sharding(True)),
    (True, {"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"}, Sharding(True, ("LlamaDecoderLayer",))),
    (True, {"transformer_layer_cls_to_wrap": ["A", "B"], "version": 2}, Sharding(True, ("A", "B"))),
    # CPU offload: transformers' "offload" word (→ fsdp_config cpu_offload), its cpu_offload key, accelerate's name
    ("full_shard offload", None, Sharding(True, offload=True)),
    (["shard_grad_op", "offload"], None, Sharding(False, offload=True)),
    (True, {"cpu_offload": True}, Sharding(True, offload=True)),
    (True, {"fsdp_offload_params": "true"}, Sharding(True, offload=True)),
    # accepted without effect (listed in docs/trl_compat.md)
    (True, {"state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": True, "use_orig_params": True,
            "sync_module_states": True, "forward_prefetch": False, "backward_prefetch": "BACKWARD_PRE",
            "limit_all_gathers": True, "min_num_params": 0, "cpu_offload": False, "xla": False}, Sharding(True)),
])
def test_fsdp_and_fsdp_config_map_onto_fsdp2(fsdp, config, expected):
    assert resolve(fsdp, config) == expected


@pytest.mark.parametrize("config, message", [
    ({"version": 1}, r"fsdp_config version 1: groupwise shards with FSDP2; set version: 2"),
    ({"cpu_offload": "sometimes"}, r"fsdp_config\['cpu_offload'\]='sometimes' is not a boolean"),
    ({"activation_checkpointing": True}, r"activation_checkpointing: true, .*set gradient_checkpointing: true instead"),
    ({"xla": True}, r"xla: true, .*XLA is not supported"),
    ({"auto_wrap_policy": "SIZE_BASED_WRAP"}, r"auto_wrap_policy='SIZE_BASED_WRAP': .*set TRANSFORMER_BASED_WRAP"),
    ({"reshard_after_forward": "sometimes"}, r"fsdp_config\['reshard_after_forward'\]='sometimes' is not a boolean"),
    ({"transformer_layer_cls_to_wrap": [1]}, r"transformer_layer_cls_to_wrap=\[1\] must be a class name"),
    ({"reshard_after_fwd": True}, r"fsdp_config has \['reshard_after_fwd'\], which are not transformers' FSDP "
                                  r"options: use \["),
    ([1, 2], r"fsdp_config must be a mapping \(or a JSON file's path\), got list"),
])
def test_what_fsdp2_does_not_do_is_refused_by_name(config, message):
    with pytest.raises(ConfigError, match=message):
        resolve(True, config)


def test_an_optimizer_that_cannot_step_shards_is_refused_with_fsdp(tmp_path, monkeypatch):
    """Adafactor with fsdp crashed at the first optimizer step ("got mixed torch.Tensor and DTensor"), after the
    models had loaded; bitsandbytes' kernels take plain CUDA tensors. Refused with the config, naming the ones that
    work (sgd / adagrad / rmsprop / adamw_torch train and resume sharded: tests/test_fsdp.py); accelerate's FSDP2
    launch asks for sharding too."""
    from groupwise import GRPOConfig

    with pytest.raises(ConfigError, match=r"optim='adafactor' cannot step FSDP2's sharded parameters: with fsdp use "
                                          r"one of \['adamw_torch_fused', 'adamw_torch', 'sgd', 'adagrad', 'rmsprop'\]"):
        GRPOConfig(output_dir=str(tmp_path), fsdp="full_shard", optim="adafactor")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    with pytest.raises(ConfigError, match=r"optim='adafactor' cannot step FSDP2's sharded parameters"):
        GRPOConfig(output_dir=str(tmp_path), optim="adafactor")
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    GRPOConfig(output_dir=str(tmp_path), optim="adafactor")  # unsharded: fine


def test_fsdp_config_from_a_json_file_or_text(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                                "fsdp_reshard_after_forward": False}))
    assert resolve(True, str(path)) == Sharding(False, ("LlamaDecoderLayer",))
    assert resolve(True, '{"reshard_after_forward": false}') == Sharding(False)
    with pytest.raises(ConfigError, match=r"fsdp_config='.*missing.json': cannot read it \(No such file"):
        resolve(True, str(tmp_path / "missing.json"))
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"is not valid JSON"):
        resolve(True, str(path))


def test_fsdp_config_without_fsdp_is_an_error_unless_it_asks_for_nothing():
    with pytest.raises(ConfigError, match=r"^fsdp_config is set but fsdp is not: set fsdp: true"):
        resolve(None, {"reshard_after_forward": False})
    # what older transformers' to_dict() wrote for an unsharded run: all defaults, no request
    assert resolve(None, {"min_num_params": 0, "xla": False, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False}) \
        is None
    assert resolve(False, None) is None and resolve("", {}) is None


def test_the_config_fields_are_checked_on_construction_before_anything_loads():
    args = GRPOConfig(fsdp=True, fsdp_config={"fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer"})
    assert args.fsdp is True
    assert GRPOConfig(fsdp="true").fsdp is True  # `--fsdp true` on the command line
    assert GRPOConfig(fsdp=["full_shard", "auto_wrap"]).fsdp == ["full_shard", "auto_wrap"]
    with pytest.raises(ConfigError, match="fsdp_config sets activation_checkpointing: true"):
        GRPOConfig(fsdp=True, fsdp_config={"activation_checkpointing": True})
    with pytest.raises(ConfigError, match=r"fsdp=\['hybrid_shard'\]: \['hybrid_shard'\] not supported"):
        GRPOConfig(fsdp=["hybrid_shard"])


def test_cpu_offload_on_gpus_gets_gloo_next_to_nccl():
    """With CPU offload the gradient norm and the fp16 overflow check reduce shards held in host memory: on GPUs
    the process group must have a CPU backend next to NCCL (accelerate sets the same for fsdp_offload_params)."""
    from groupwise.sharding import process_group_backend

    offload, plain = Sharding(True, offload=True), Sharding(True)
    assert process_group_backend(None, offload, cuda=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend("cuda:nccl,cpu:gloo", offload, cuda=True) == "cuda:nccl,cpu:gloo"
    assert process_group_backend(None, offload, cuda=False) is None  # CPU processes: gloo, torch's default
    assert process_group_backend("nccl", plain, cuda=True) == "nccl"
    assert process_group_backend(None, None, cuda=True) is None
    with pytest.raises(ConfigError, match=r"^fsdp with CPU offload and ddp_backend='nccl': .*leave ddp_backend unset, "
                                          r"or set it to 'cuda:nccl,cpu:gloo'"):
        process_group_backend("nccl", offload, cuda=True)
