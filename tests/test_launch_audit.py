"""What an `accelerate launch` brings with it (the environment variables it exports) and what groupwise does with
each: honoured, or refused with a one-line error naming the key and the fix. In-process: the variables are set with
monkeypatch as accelerate exports them (accelerate.utils.launch.prepare_multi_gpu_env)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from groupwise.config_base import ConfigError
from groupwise.distributed import Distributed
from tests.conftest import small_args
from tests.launcher import free_port

ROOT = Path(__file__).parents[1]


def _fsdp2_launch(monkeypatch, **env):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    for key, value in env.items():
        monkeypatch.setenv(key, value)


# ---- mixed precision ----------------------------------------------------------------------------------------------
def test_accelerate_mixed_precision_fp8_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ConfigError, match=r"^the accelerate config sets mixed_precision: fp8, .*set "
                                          "mixed_precision: bf16, fp16 or no in the accelerate config"):
        Distributed()
    assert Distributed(bf16=True).accelerator.mixed_precision == "bf16"  # the field wins, as in transformers
    assert Distributed(fp16=True).precision == "fp16"


@pytest.mark.parametrize("precision", ["bf16", "fp16", "no"])
def test_accelerate_mixed_precision_is_honoured(monkeypatch, precision):
    from groupwise.distributed import launch_precision

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", precision)
    dist = Distributed()
    assert dist.precision == launch_precision() == precision
    # bf16 through accelerate's autocast; fp16 through groupwise's own autocast and loss scale (accelerate's is
    # GPU-only), so accelerate itself is told "no"
    assert dist.accelerator.mixed_precision == ("bf16" if precision == "bf16" else "no")
    assert (dist.scaler is not None) is (precision == "fp16")


# ---- gradient accumulation and dynamo -----------------------------------------------------------------------------
def test_accelerate_gradient_accumulation_steps_does_not_divide_the_loss_again(monkeypatch):
    monkeypatch.setenv("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "4")  # groupwise scales for its own field
    dist = Distributed()
    assert dist.accelerator.gradient_accumulation_steps == 1
    layer = torch.nn.Linear(2, 1, bias=False)
    layer, _ = dist.prepare(layer, torch.optim.SGD(layer.parameters(), lr=0.1))
    dist.backward(layer(torch.ones(1, 2)).sum())
    assert torch.equal(layer.weight.grad, torch.ones(1, 2))


def test_accelerate_dynamo_backend_is_refused_by_name_and_no_is_accepted(monkeypatch):
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "NO")  # what `accelerate launch` exports by default
    Distributed()
    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "INDUCTOR")
    with pytest.raises(ConfigError, match=r"^the accelerate config sets dynamo_backend: INDUCTOR, .*torch_compile: "
                                          r"true \(torch_compile_backend: inductor\)"):
        Distributed()


# ---- FSDP2 options ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["SIZE_BASED_WRAP", "NO_WRAP"])
def test_fsdp_auto_wrap_policy_other_than_transformer_based_is_refused(monkeypatch, policy):
    from groupwise import GRPOConfig

    _fsdp2_launch(monkeypatch, FSDP_AUTO_WRAP_POLICY=policy)
    with pytest.raises(ConfigError, match=rf"fsdp_auto_wrap_policy: {policy}.*set fsdp_auto_wrap_policy: "
                                          "TRANSFORMER_BASED_WRAP"):
        GRPOConfig()


def test_fsdp_reshard_after_forward_values(monkeypatch):
    from groupwise.sharding import resolve

    _fsdp2_launch(monkeypatch, FSDP_AUTO_WRAP_POLICY="TRANSFORMER_BASED_WRAP")
    for value, reshard in (("true", True), ("false", False), ("True", True), ("0", False)):
        monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", value)
        assert resolve(None).reshard_after_forward is reshard
    # HYBRID_SHARD used to shard as shard_grad_op, silently; FULL_SHARD (FSDP1's spelling) was taken here, then
    # accelerate's Accelerator() failed on it with a traceback ("invalid truth value full_shard")
    for value in ("HYBRID_SHARD", "FULL_SHARD", "shard_grad_op"):
        monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", value)
        with pytest.raises(ConfigError, match=rf"fsdp_reshard_after_forward: {value}, which FSDP2 does not read: set "
                                              r"it to true \(FULL_SHARD\) or false \(SHARD_GRAD_OP\)"):
            resolve(None)


def test_examples_fsdp2_yaml_is_an_accelerate_config_whose_launch_groupwise_takes(monkeypatch):
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    from groupwise.distributed import check_launch
    from groupwise.sharding import Sharding, resolve

    config_file = str(ROOT / "examples/accelerate/fsdp2.yaml")
    config = load_config_from_file(config_file)
    assert (config.distributed_type, config.mixed_precision, config.fsdp_config["fsdp_version"]) == \
        ("FSDP", "bf16", 2)
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", config_file, "x.py"]))
    env = prepare_multi_gpu_env(args)  # what the 8 processes would see
    for key, value in env.items():
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.setenv(key, value)
    assert resolve(None) == Sharding(reshard_after_forward=True)
    check_launch(False)


@pytest.fixture
def one_process_group(monkeypatch):
    import torch.distributed as torch_dist

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    torch_dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        torch_dist.destroy_process_group()


def test_fsdp_transformer_layer_cls_to_wrap_is_honoured_or_refused_by_name(monkeypatch, tokenizer, one_process_group):
    from torch.distributed.fsdp import FSDPModule

    from groupwise.sharding import resolve, shard
    from groupwise.tasks import toy

    _fsdp2_launch(monkeypatch, FSDP_TRANSFORMER_CLS_TO_WRAP="LlamaMLP, LlamaAttention")
    sharding = resolve(None)
    assert sharding.layer_classes == ("LlamaMLP", "LlamaAttention")
    model = toy.build_model(tokenizer, seed=0, hidden_size=32)
    shard(model, model, sharding, torch.device("cpu"))
    units = {type(m).__name__.removeprefix("FSDP") for m in model.modules() if isinstance(m, FSDPModule)}
    assert {"LlamaMLP", "LlamaAttention"} <= units and "LlamaDecoderLayer" not in units
    monkeypatch.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "GPT2Block")
    with pytest.raises(ConfigError, match=r"the accelerate config's fsdp_transformer_layer_cls_to_wrap names "
                                          r"\['GPT2Block'\], which LlamaForCausalLM does not contain: name its decoder"):
        shard(*(2 * [toy.build_model(tokenizer, seed=0, hidden_size=32)]), resolve(None), torch.device("cpu"))
    monkeypatch.delenv("ACCELERATE_USE_FSDP")  # the field's fsdp_config names the class: that is named, not accelerate
    with pytest.raises(ConfigError, match=r"^fsdp_config's transformer_layer_cls_to_wrap names \['Qwen2DecoderLayer'\]"):
        shard(*(2 * [toy.build_model(tokenizer, seed=0, hidden_size=32)]),
              resolve("full_shard", {"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}), torch.device("cpu"))


def test_fsdp_layer_classes_are_refused_before_the_weights_load(monkeypatch, tmp_path, tokenizer, model_dir,
                                                               one_process_group):
    """A wrong transformer_layer_cls_to_wrap, or a model without _no_split_modules, was refused only once every
    process had loaded the weights (minutes for an 8B model): the model is now built from its config on the meta
    device first."""
    import transformers

    from groupwise import GRPOTrainer
    from groupwise.sharding import Sharding, check_layers_before_loading
    from groupwise.tasks import toy

    def no_load(*a, **k):
        raise AssertionError("the weights loaded before the error")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_load)
    args = small_args(tmp_path, fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrap": ["GPT2Block"]})
    with pytest.raises(ConfigError, match=r"^fsdp_config's transformer_layer_cls_to_wrap names \['GPT2Block'\], "
                                          r"which LlamaForCausalLM does not contain"):
        GRPOTrainer(model_dir, [toy.letter_reward], args=args, train_dataset=toy.dataset(8))
    gpt = tmp_path / "gpt"  # openai-gpt declares no _no_split_modules
    transformers.OpenAIGPTLMHeadModel(transformers.OpenAIGPTConfig(n_layer=2, n_embd=16, n_head=2,
                                                                   vocab_size=64)).save_pretrained(gpt)
    with pytest.raises(ConfigError, match=r"OpenAIGPTLMHeadModel declares no decoder layer classes .*"
                                          r"\(its repeated blocks: \['Block'\]\)"):
        check_layers_before_loading(str(gpt), Sharding(True), {})
    check_layers_before_loading(model_dir, Sharding(True), {"dtype": torch.bfloat16})  # the model's own: fine
    check_layers_before_loading(str(tmp_path / "not-a-model"), Sharding(True), {})  # left to the load's own error


# ---- seeding ------------------------------------------------------------------------------------------------------
def test_models_load_with_the_same_seed_on_every_process_then_each_samples_with_seed_plus_rank(monkeypatch, tmp_path,
                                                                                              tokenizer):
    """TRL: set_seed(args.seed) before the models are created, set_seed(args.seed, device_specific=True) after. A
    weight drawn while loading (LoRA's, a key missing from the checkpoint) used to differ between processes: DDP
    broadcast the policy's, but not π_ref's, nor FSDP2's shards or generation replica."""
    from groupwise import GRPOTrainer
    from groupwise import trainer as trainer_module
    from groupwise.tasks import toy

    class Stop(Exception):
        pass

    seeds = {}
    load_policy = trainer_module.load_policy

    def loading(*a, **kw):
        seeds["load"] = torch.initial_seed()
        return load_policy(*a, **kw)

    def rollout(self):
        seeds["sample"] = torch.initial_seed()
        raise Stop

    monkeypatch.setattr(Distributed, "rank", property(lambda self: 1))  # the second process's view of the run
    monkeypatch.setattr(trainer_module, "load_policy", loading)
    monkeypatch.setattr(GRPOTrainer, "_build_rollout", rollout)
    with pytest.raises(Stop):
        GRPOTrainer(toy.build_model(tokenizer, seed=0, hidden_size=32), [toy.letter_reward],
                    args=small_args(tmp_path, seed=7), train_dataset=toy.dataset(8), processing_class=tokenizer)
    assert seeds == {"load": 7, "sample": 8}


def test_a_launch_accelerate_reads_as_fewer_processes_is_refused(monkeypatch):
    """torchrun / accelerate launch on CPUs without ACCELERATE_USE_CPU=1: accelerate saw one process each, so two
    runs trained alone into one output_dir (one failing on the other's checkpoint) and a sharded one waited on the
    others until ddp_timeout. WORLD_SIZE is what the launcher exports."""
    from groupwise.distributed import Distributed

    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"the launcher started 2 processes \(WORLD_SIZE=2\) but accelerate sees 1; "
                                          r"on CPUs set ACCELERATE_USE_CPU=1 in the launch's environment"):
        Distributed()
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert Distributed().world_size == 1


@pytest.mark.slow
def test_two_processes_launched_without_accelerate_use_cpu_stop_at_once(tmp_path):
    """The real launch: each of the 2 processes stops with the line, none trains or waits."""
    from tests.launcher import torchrun

    script = tmp_path / "build.py"
    script.write_text("from groupwise.distributed import Distributed\nDistributed()\nprint('built')\n")
    proc = torchrun(script, env={"ACCELERATE_USE_CPU": "0"}, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "built" not in out, out[-2000:]
    assert out.count("the launcher started 2 processes (WORLD_SIZE=2) but accelerate sees 1") == 2, out[-2000:]
